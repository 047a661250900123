"""The KV cache: one token pool per layer, allocated once, carved into contiguous regions.

Why a token pool with contiguous regions rather than fixed slots or pages:
- fixed slots must each be sized for the longest request (a 20-minute piece needs 16k tokens), which
  wastes most of the memory on short clips;
- pages need a paged-attention kernel, and a gather of scattered pages per step costs more memory
  traffic than the attention itself on a CPU;
- a contiguous (kv_heads, tokens, head_dim) region per request is read by prefill attention as a plain
  view, and by the decode kernel as one linear stream, with no copy.
A request reserves ``prompt + max_new_tokens`` tokens at admission (first fit); it is freed when the
request ends. Admission waits while no region is free, so memory never exceeds the budget.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch
import torch.nn.functional as F

from qasr.engine.padded_attention import PaddedPlan, padded_attention, padded_plan
from qasr.model.config import DecoderConfig


@dataclass(frozen=True)
class AttentionMeta:
    """Where each packed sequence lives in this pool and how many tokens it brings: the metadata
    ``KVPool.attend`` reads for one forward (the model passes it through unread).

    Sequences that bring exactly one token (decode) come first; the decode tensors are built once per
    forward so the cache does no host work per layer.
    """

    starts: tuple[int, ...]  # first cache token of each sequence's region
    query_lens: tuple[int, ...]  # new tokens per sequence in this forward
    context_lens: tuple[int, ...]  # tokens already cached per sequence before this forward
    num_decode: int = 0  # leading sequences with exactly one new token
    decode_starts: torch.Tensor | None = None  # (num_decode,) int64
    decode_lens: torch.Tensor | None = None  # (num_decode,) tokens attended (context + 1)
    decode_write_index: torch.Tensor | None = None  # (num_decode,) cache index of the new token

    @classmethod
    def build(cls, starts: list[int], query_lens: list[int], context_lens: list[int],
              device: torch.device, num_decode: int = 0) -> AttentionMeta:
        """``num_decode``: how many leading sequences are decode steps. A one-token prefill chunk is
        not counted among them even when it follows the decode rows: it must take the prefill path in
        every batch, or its result would depend on whether other chunks precede it."""
        nd = num_decode
        assert all(n == 1 for n in query_lens[:nd]), "decode rows bring exactly one token"
        st = torch.tensor(starts[:nd], dtype=torch.int64)
        ctx = torch.tensor(context_lens[:nd], dtype=torch.int64)
        return cls(tuple(starts), tuple(query_lens), tuple(context_lens), nd,
                   st.to(device), (ctx + 1).to(device), (st + ctx).to(device))

    @cached_property
    def padded(self) -> PaddedPlan:
        """The decode rows' gather plan for the portable attention, built once per forward on first use."""
        nd = self.num_decode
        assert self.decode_starts is not None and nd, "only decode rows take the padded path"
        return padded_plan(self.starts[:nd], self.query_lens[:nd], self.context_lens[:nd], self.decode_starts.device)


def kv_bytes_per_token(cfg: DecoderConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


class RegionAllocator:
    """First-fit allocator of contiguous token ranges in [0, capacity); merges neighbours on free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, length)
        self.used = 0

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, n))
        self.used -= n
        # merge with the right, then the left neighbour
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:
            self._free[i] = (start, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


class KVPool:
    def __init__(self, cfg: DecoderConfig, tokens: int, device: torch.device, dtype: torch.dtype,
                 decode_kernel: ModuleType | None = None, prefill_kernel: ModuleType | None = None) -> None:
        """``decode_kernel`` / ``prefill_kernel``: native attention modules chosen by engine/device.py
        (None: torch's SDPA, same maths)."""
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, tokens, cfg.head_dim)
        # empty, not zeros: every slot is written before it is read, and untouched pages cost no RAM
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.tokens = tokens
        self.heads = cfg.num_attention_heads
        self.scale = cfg.head_dim ** -0.5
        self.allocator = RegionAllocator(tokens)
        self.kernel = decode_kernel
        self.prefill_kernel = prefill_kernel

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy the keys and values of n tokens from one region to another (non-overlapping)."""
        self.k[:, :, dst:dst + n] = self.k[:, :, src:src + n]
        self.v[:, :, dst:dst + n] = self.v[:, :, src:src + n]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def build_meta(self, starts: list[int], query_lens: list[int], context_lens: list[int],
                   num_decode: int = 0) -> AttentionMeta:
        """The metadata ``attend`` reads for one packed forward (each pool layout builds its own)."""
        return AttentionMeta.build(starts, query_lens, context_lens, self.k.device, num_decode=num_decode)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd).

        Rows are ordered: first ``meta.num_decode`` single-token sequences, then prefill chunks.
        """
        kc, vc = self.k[layer], self.v[layer]
        nd = meta.num_decode
        outs = []
        if nd:
            if self.kernel is not None:  # the kernel also stores the new keys/values
                out = self.kernel.decode_attention(q[:nd].contiguous(), kc, vc, meta.decode_starts,
                                                   meta.decode_lens, self.scale, k[:nd], v[:nd])
                outs.append(out.reshape(nd, -1))
            else:
                idx = meta.decode_write_index
                kc[:, idx] = k[:nd].transpose(0, 1)
                vc[:, idx] = v[:nd].transpose(0, 1)
                # the portable path (GPUs, or CPUs without the kernel), over the pool seen token-major
                outs.append(padded_attention(q[:nd], kc.transpose(0, 1), vc.transpose(0, 1), meta.padded,
                                             self.scale))
        row = nd
        for i in range(nd, len(meta.starts)):
            n, ctx, start = meta.query_lens[i], meta.context_lens[i], meta.starts[i]
            kc[:, start + ctx:start + ctx + n] = k[row:row + n].transpose(0, 1)
            vc[:, start + ctx:start + ctx + n] = v[row:row + n].transpose(0, 1)
            outs.append(self._one(q[row:row + n], kc, vc, start, ctx, n))
            row += n
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]

    def _one(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int, ctx: int,
             n: int) -> torch.Tensor:
        """Attention of n new tokens (already written) over the sequence's first ctx + n tokens."""
        if self.prefill_kernel is not None:
            return self.prefill_kernel.prefill_attention(q, kc, vc, start, ctx, self.scale).reshape(n, -1)
        end = start + ctx + n
        qi = q.transpose(0, 1).unsqueeze(0)  # (1, heads, n, hd)
        keys, values = kc[:, start:end].unsqueeze(0), vc[:, start:end].unsqueeze(0)
        if n == 1:
            o = F.scaled_dot_product_attention(qi, keys, values, scale=self.scale, enable_gqa=True)
        elif ctx == 0:
            o = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            allowed = torch.arange(ctx + n, device=q.device)[None, :] <= (
                ctx + torch.arange(n, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=allowed, scale=self.scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, -1)
