"""The portable attention both KV pools fall back on: gather each sequence's queries and keys into one
padded batch and run one masked SDPA (torch only, any device, any dtype).

The CPU pool (engine/kv_cache.py) uses it for decode rows where its native kernel is absent; the CUDA
pool (engine/cuda/attention.py) for every row where flash cannot run, and as the reference its flash path
is checked against. The gather costs one extra pass over the keys, which a GPU's bandwidth absorbs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PaddedPlan:
    """Index tensors that lay the packed rows out as an (S, max_q) x (S, max_k) padded batch."""

    q_index: torch.Tensor  # (S, max_q) int64: packed query row per slot (pad slots repeat the last row)
    k_index: torch.Tensor  # (S, max_k) int64: pool row per key slot, through the block table (pads repeat the last key)
    mask: torch.Tensor  # (S, 1, max_q, max_k) bool: key j visible to query slot i
    out_index: torch.Tensor  # (N,) int64: flat (S * max_q) slot of each packed query row


def padded_plan(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                context_lens: Sequence[int], device: torch.device | str = "cpu") -> PaddedPlan:
    """Sequence b brings query_lens[b] new tokens after context_lens[b] cached ones; its position p lives at
    pool row tables[b][p // block_size] * block_size + p % block_size. Pad slots point at real rows of the
    sequence itself (never at memory outside its blocks, which may hold NaN: a masked NaN key still
    poisons a softmax), and every query slot sees at least one key."""
    ql = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    used = ctx + ql
    max_q, max_k = int(ql.max()), int(used.max())
    width = max(len(t) for t in tables)
    tab = torch.zeros(len(tables), width, dtype=torch.int64)
    for b, t in enumerate(tables):
        tab[b, :len(t)] = torch.tensor(t, dtype=torch.int64)
    first = torch.cumsum(ql, 0) - ql
    i = torch.arange(max_q)[None, :]
    j = torch.arange(max_k)[None, :]
    q_index = first[:, None] + torch.minimum(i, (ql - 1)[:, None])
    pos = torch.minimum(j, (used - 1)[:, None])  # (S, max_k) positions, pads repeat the last key
    k_index = torch.gather(tab, 1, pos // block_size) * block_size + pos % block_size
    # bottom-right causal: query i of n new tokens over ctx cached ones sees keys 0 .. ctx + i
    mask = (j[:, None, :] <= (ctx[:, None] + i)[:, :, None]) & (j < used[:, None])[:, None, :]
    out_index = torch.cat([b * max_q + torch.arange(n) for b, n in enumerate(query_lens)])
    return PaddedPlan(q_index.to(device), k_index.to(device), mask[:, None].to(device), out_index.to(device))


def padded_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: PaddedPlan,
                     scale: float) -> torch.Tensor:
    """q (N, heads, hd) packed; kc / vc one layer's keys and values indexed by pool row first, (tokens,
    kv_heads, hd) with any strides (the head-major CPU pool passes a transposed view), with this forward's
    new keys already stored -> (N, heads * hd)."""
    s, max_q = plan.q_index.shape
    n, heads, hd = q.shape
    qp = q[plan.q_index].transpose(1, 2)  # (S, heads, max_q, hd)
    keys = kc[plan.k_index].transpose(1, 2)  # (S, kv_heads, max_k, hd)
    values = vc[plan.k_index].transpose(1, 2)
    o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(s * max_q, heads * hd)[plan.out_index]
