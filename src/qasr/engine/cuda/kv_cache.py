"""The CUDA backend's KV pool: blocks as in engine/kv_cache.py, laid out token-major, ``(layers, tokens + 1,
kv_heads, head_dim)``, as varlen flash reads keys. The last row is scratch for a decode graph's pad rows."""

from __future__ import annotations

import torch

from qasr.engine.cuda.attention import Attention, reference_attention
from qasr.engine.cuda.plan import VarlenMeta
from qasr.engine.kv_blocks import BlockAllocator
from qasr.model.config import DecoderConfig


class TokenKVPool:
    def __init__(self, cfg: DecoderConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, attention: Attention = reference_attention) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        tokens = num_blocks * block_size
        shape = (cfg.num_hidden_layers, tokens + 1, cfg.num_key_value_heads, cfg.head_dim)
        # empty: every row is written before it is read
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.tokens = tokens
        self.scratch = tokens
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: VarlenMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd); stores k/v first."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, meta.write_index, k.to(kc.dtype))
        vc.index_copy_(0, meta.write_index, v.to(vc.dtype))
        return self.attention(q, kc, vc, meta, self.scale)
