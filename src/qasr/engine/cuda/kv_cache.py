"""The CUDA backend's KV pool: the same token pool with contiguous regions as ``engine/kv_cache.py``, laid
out token-major, ``(layers, tokens + 1, kv_heads, head_dim)``, the packed-key layout that varlen flash
kernels read in place (the CPU pool is head-major, which its decode kernel streams best).

The extra last row is scratch: the pad rows of a bucketed decode graph write their keys there and
attend only to it, so padding never touches a request's region. The allocator hands out [0, tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qasr.engine.cuda.attention import Attention, reference_attention
from qasr.engine.cuda.plan import VarlenMeta, upload, varlen_host
from qasr.engine.kv_cache import RegionAllocator
from qasr.model.config import DecoderConfig


class TokenKVPool:
    def __init__(self, cfg: DecoderConfig, tokens: int, device: torch.device, dtype: torch.dtype,
                 attention: Attention = reference_attention) -> None:
        shape = (cfg.num_hidden_layers, tokens + 1, cfg.num_key_value_heads, cfg.head_dim)
        # empty: every row is written before it is read (the attention never reads outside a region)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.tokens = tokens
        self.scratch = tokens  # row index of the scratch row
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        self.allocator = RegionAllocator(tokens)
        self.attention = attention

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy the keys and values of n tokens from one region to another (non-overlapping)."""
        self.k[:, dst:dst + n] = self.k[:, src:src + n]
        self.v[:, dst:dst + n] = self.v[:, src:src + n]

    def build_meta(self, starts: Sequence[int], query_lens: Sequence[int], context_lens: Sequence[int],
                   num_decode: int = 0) -> VarlenMeta:
        """Attention metadata for one packed forward, uploaded in two copies (int32 and int64)."""
        host = varlen_host(starts, query_lens, context_lens)
        cu_q, k_starts, used = upload([host.cu_q, host.k_starts, host.used_k], torch.int32, self.device)
        (write,) = upload([host.write_index], torch.int64, self.device)
        return VarlenMeta(tuple(starts), tuple(query_lens), tuple(context_lens), num_decode, cu_q, k_starts, used,
                          write, host.max_q, host.max_k)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: VarlenMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd): store the new keys and values
        at their rows (one scatter per layer, no per-sequence loop), then one varlen attention call."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, meta.write_index, k.to(kc.dtype))
        vc.index_copy_(0, meta.write_index, v.to(vc.dtype))
        return self.attention(q, kc, vc, meta, self.scale)
