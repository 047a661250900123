"""A KV cache allocated once: per layer, keys and values for ``slots`` sequences of ``capacity`` tokens.

Slots (not pages): on the CPU there is no paged-attention kernel, and a slot's keys are one
contiguous (kv_heads, capacity, head_dim) block, so attention reads a plain view of the cache with
no gather or copy per step. The engine sizes slots from a memory budget and admits a request only
when a slot large enough for its prompt plus its token cap is free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qasr.model.config import DecoderConfig
from qasr.model.decoder import AttentionMeta


def kv_bytes_per_token(cfg: DecoderConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


class SlotKVCache:
    def __init__(self, cfg: DecoderConfig, slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = slots
        self.capacity = capacity
        self.scale = cfg.head_dim ** -0.5

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd); writes k/v into the slots first."""
        kc, vc = self.k[layer], self.v[layer]
        outs = []
        row = 0
        for slot, n, ctx in zip(meta.slots, meta.query_lens, meta.context_lens, strict=True):
            end = ctx + n
            if end > self.capacity:
                raise RuntimeError(f"sequence of {end} tokens overflows the KV slot ({self.capacity})")
            kc[slot, :, ctx:end] = k[row:row + n].transpose(0, 1)
            vc[slot, :, ctx:end] = v[row:row + n].transpose(0, 1)
            qi = q[row:row + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, hd)
            keys, values = kc[slot, :, :end].unsqueeze(0), vc[slot, :, :end].unsqueeze(0)
            if n == 1:
                o = F.scaled_dot_product_attention(qi, keys, values, enable_gqa=True)
            elif ctx == 0:
                o = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, enable_gqa=True)
            else:
                allowed = torch.arange(end, device=q.device)[None, :] <= (
                    ctx + torch.arange(n, device=q.device)[:, None])
                o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=allowed, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            row += n
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]
