"""The CUDA backend's KV pool: blocks as in engine/kv_cache.py, laid out as flash's paged path reads them,
``(layers, blocks + 1, block_size, kv_heads, head_dim)``. The last block is scratch for a decode graph's pad rows.
Every pool on a device is counted in one budget (``held_kv_bytes``)."""

from __future__ import annotations

import weakref

import torch

from qasr.engine.cuda.attention import Attention, flash_attention, reference_attention, rows_of
from qasr.engine.cuda.plan import FLASH_BLOCK_TOKENS, VarlenMeta
from qasr.engine.kv_blocks import BlockAllocator
from qasr.model.config import DecoderConfig

_pools: weakref.WeakSet[TokenKVPool] = weakref.WeakSet()


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def held_kv_bytes(device: torch.device) -> int:
    """Bytes held by the live KV pools on ``device``."""
    return sum(p.nbytes for p in list(_pools) if _same(p.device, torch.device(device)))


class TokenKVPool:
    def __init__(self, cfg: DecoderConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, attention: Attention = reference_attention) -> None:
        if attention is flash_attention and block_size % FLASH_BLOCK_TOKENS:
            raise ValueError(f"flash's paged attention reads KV blocks of a multiple of {FLASH_BLOCK_TOKENS} tokens; "
                             f"kv_block_tokens is {block_size} (leave it at its default on CUDA)")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.tokens = num_blocks * block_size
        self.scratch_block = num_blocks
        self.scratch = num_blocks * block_size  # the scratch block's first row
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # empty: every row is written before it is read
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention
        _pools.add(self)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: VarlenMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd); stores k/v first."""
        kc, vc = self.k[layer], self.v[layer]
        rows_of(kc).index_copy_(0, meta.write_index, k.to(kc.dtype))
        rows_of(vc).index_copy_(0, meta.write_index, v.to(vc.dtype))
        return self.attention(q, kc, vc, meta, self.scale)
