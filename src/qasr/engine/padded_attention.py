"""The portable attention both KV pools fall back on: each sequence's queries and keys gathered into one
padded batch for one masked SDPA (torch only, any device and dtype)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PaddedPlan:

    q_index: torch.Tensor  # (S, max_q) int64 packed query row per slot
    k_index: torch.Tensor  # (S, max_k) int64 pool row per key slot
    mask: torch.Tensor  # (S, 1, max_q, max_k) bool: key j visible to query slot i
    out_index: torch.Tensor  # (N,) int64 flat slot of each packed query row


def padded_plan(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                context_lens: Sequence[int], device: torch.device | str = "cpu") -> PaddedPlan:
    """Sequence b brings query_lens[b] tokens after context_lens[b] in blocks tables[b]. Pad slots repeat
    the sequence's own rows: memory outside its blocks may hold NaN, which a mask does not stop."""
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
    pos = torch.minimum(j, (used - 1)[:, None])
    k_index = torch.gather(tab, 1, pos // block_size) * block_size + pos % block_size
    # causal at the bottom right: query i sees keys 0 .. ctx + i
    mask = (j[:, None, :] <= (ctx[:, None] + i)[:, :, None]) & (j < used[:, None])[:, None, :]
    out_index = torch.cat([b * max_q + torch.arange(n) for b, n in enumerate(query_lens)])
    return PaddedPlan(q_index.to(device), k_index.to(device), mask[:, None].to(device), out_index.to(device))


def padded_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: PaddedPlan,
                     scale: float) -> torch.Tensor:
    """q (N, heads, hd); kc / vc (tokens, kv_heads, hd), any strides, new keys stored -> (N, heads * hd)."""
    s, max_q = plan.q_index.shape
    n, heads, hd = q.shape
    qp = q[plan.q_index].transpose(1, 2)
    keys = kc[plan.k_index].transpose(1, 2)
    values = vc[plan.k_index].transpose(1, 2)
    o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(s * max_q, heads * hd)[plan.out_index]
