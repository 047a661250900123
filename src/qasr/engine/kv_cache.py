"""The CPU KV cache: per layer a ``(kv_heads, tokens, head_dim)`` key and value tensor, handed out in blocks,
in the model's dtype or int8 with a float32 scale per (token, kv head) row (the torch definition below)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from qasr.engine.config import KV_CACHE_DTYPES
from qasr.engine.kv_blocks import BlockAllocator, token_rows
from qasr.engine.padded_attention import PaddedPlan, padded_attention, padded_plan
from qasr.model.config import DecoderConfig

DEFAULT_BLOCK_TOKENS = 64  # why 64: docs/engine.md
_INV127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)  # float32(1 / 127)


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) int8, scale (...) float32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division, not a reciprocal then a product (two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv).round().clamp(-127, 127).to(torch.int8)
    return q, (amax * _INV127).squeeze(-1)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D) int8 and scale (...) -> the values read, in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantizer(kernel: ModuleType | None) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    if kernel is not None and hasattr(kernel, "quantize_kv"):
        return kernel.quantize_kv
    return quantize_kv_reference


def row_dequantizer(kernel: ModuleType | None, dtype: torch.dtype) -> Callable[..., None] | None:
    if kernel is not None and hasattr(kernel, "dequantize_kv_rows") and dtype in (torch.bfloat16, torch.float32):
        return kernel.dequantize_kv_rows
    return None


@dataclass(frozen=True)
class AttentionMeta:
    """What ``KVPool.attend`` reads for one forward, for every layer; decode sequences first."""

    tables: tuple[tuple[int, ...], ...]
    block_size: int
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # cached tokens per sequence
    num_decode: int
    decode_tables: torch.Tensor  # (num_decode, widest table) int64, padded with block 0
    decode_lens: torch.Tensor  # (num_decode,) context + 1
    decode_write_index: torch.Tensor  # (num_decode,)
    prefill_tables: tuple[torch.Tensor, ...]
    prefill_write_index: tuple[torch.Tensor, ...]

    @classmethod
    def build(cls, tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
              context_lens: Sequence[int], device: torch.device, num_decode: int = 0) -> AttentionMeta:
        """``num_decode`` leading sequences are decode rows (a one-token prefill chunk is not one)."""
        nd = num_decode
        assert all(n == 1 for n in query_lens[:nd]), "decode rows bring exactly one token"
        tabs = tuple(tuple(t) for t in tables)
        for t, n, c in zip(tabs, query_lens, context_lens, strict=True):
            assert len(t) * block_size >= c + n, "a sequence's block table must hold all its tokens"
        width = max((len(t) for t in tabs[:nd]), default=0)
        dt = np.zeros((nd, width), dtype=np.int64)
        for i, t in enumerate(tabs[:nd]):
            dt[i, :len(t)] = t
        ctx = np.asarray(context_lens[:nd], dtype=np.int64)
        write = dt[np.arange(nd), ctx // block_size] * block_size + ctx % block_size
        pt = tuple(torch.tensor(t, dtype=torch.int64, device=device) for t in tabs[nd:])
        pw = tuple(torch.from_numpy(token_rows(t, block_size, c, c + n)).to(device)
                   for t, n, c in zip(tabs[nd:], query_lens[nd:], context_lens[nd:], strict=True))
        return cls(tabs, block_size, tuple(query_lens), tuple(context_lens), nd, torch.from_numpy(dt).to(device),
                   torch.from_numpy(ctx + 1).to(device), torch.from_numpy(write).to(device), pt, pw)

    @cached_property
    def padded(self) -> PaddedPlan:
        nd = self.num_decode
        assert nd, "only decode rows take the padded path"
        return padded_plan(self.tables[:nd], self.block_size, self.query_lens[:nd], self.context_lens[:nd],
                           self.decode_lens.device)

    @cached_property
    def compact_decode(self) -> tuple[torch.Tensor, PaddedPlan]:
        """The distinct pool rows decode reads, and ``padded`` indexing a compact copy of them."""
        plan = self.padded
        rows, inverse = torch.unique(plan.k_index, sorted=True, return_inverse=True)
        return rows, replace(plan, k_index=inverse)

    @cached_property
    def prefill_key_rows(self) -> tuple[torch.Tensor, ...]:
        nd = self.num_decode
        return tuple(torch.from_numpy(token_rows(t, self.block_size, 0, c + n)).to(self.decode_lens.device)
                     for t, n, c in zip(self.tables[nd:], self.query_lens[nd:], self.context_lens[nd:], strict=True))


def kv_bytes_per_token(cfg: DecoderConfig, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    rows = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
    if kv_dtype == "int8":
        return rows * (cfg.head_dim + 4)
    return rows * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(self, cfg: DecoderConfig, num_blocks: int, device: torch.device, dtype: torch.dtype, *,
                 block_size: int = DEFAULT_BLOCK_TOKENS, decode_kernel: ModuleType | None = None,
                 prefill_kernel: ModuleType | None = None, kv_dtype: str = "auto") -> None:
        """``decode_kernel`` / ``prefill_kernel``: native attention modules, or None for torch's SDPA;
        ``kv_dtype``: "auto" (``dtype``) or "int8"."""
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.tokens = tokens = num_blocks * block_size
        self.dtype = dtype
        self.int8 = kv_dtype == "int8"
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, tokens, cfg.head_dim)
        store = torch.int8 if self.int8 else dtype
        self.k = torch.empty(shape, device=device, dtype=store)
        self.v = torch.empty(shape, device=device, dtype=store)
        if self.int8:
            self.k_scale = torch.empty(shape[:-1], device=device, dtype=torch.float32)
            self.v_scale = torch.empty(shape[:-1], device=device, dtype=torch.float32)
            self.quantize = quantizer(decode_kernel)
            self.dequantize_rows = row_dequantizer(decode_kernel, dtype)
            self.store_int8 = (getattr(decode_kernel, "store_kv_int8", None)
                               if dtype in (torch.bfloat16, torch.float32) else None)
        self.heads = cfg.num_attention_heads
        self.scale = cfg.head_dim ** -0.5
        self.kernel = decode_kernel
        self.prefill_kernel = prefill_kernel

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.numel() * 4 * 2 if self.int8 else 0
        return self.k.numel() * self.k.element_size() * 2 + scales

    def build_meta(self, tables: Sequence[Sequence[int]], query_lens: Sequence[int], context_lens: Sequence[int],
                   num_decode: int = 0) -> AttentionMeta:
        return AttentionMeta.build(tables, self.block_size, query_lens, context_lens, self.k.device,
                                   num_decode=num_decode)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd), decode rows first -> (N, heads * hd); stores k/v."""
        if self.int8:
            return self._attend_int8(layer, q, k, v, meta)
        kc, vc = self.k[layer], self.v[layer]
        nd = meta.num_decode
        outs = []
        if nd:
            if self.kernel is not None:  # it stores k/v too
                out = self.kernel.decode_attention(q[:nd].contiguous(), kc, vc, meta.decode_tables, meta.decode_lens,
                                                   meta.block_size, self.scale, k[:nd], v[:nd])
                outs.append(out.reshape(nd, -1))
            else:
                idx = meta.decode_write_index
                kc[:, idx] = k[:nd].transpose(0, 1)
                vc[:, idx] = v[:nd].transpose(0, 1)
                outs.append(padded_attention(q[:nd], kc.transpose(0, 1), vc.transpose(0, 1), meta.padded,
                                             self.scale))
        row = nd
        for i in range(len(meta.tables) - nd):
            n, ctx = meta.query_lens[nd + i], meta.context_lens[nd + i]
            write = meta.prefill_write_index[i]
            kc[:, write] = k[row:row + n].transpose(0, 1)
            vc[:, write] = v[row:row + n].transpose(0, 1)
            if self.prefill_kernel is not None:
                o = self.prefill_kernel.prefill_attention(q[row:row + n], kc, vc, meta.prefill_tables[i],
                                                          meta.block_size, ctx, self.scale)
            else:
                o = self._gathered(q[row:row + n], kc, vc, meta.prefill_key_rows[i], ctx)
            outs.append(o.reshape(n, -1))
            row += n
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]

    def _attend_int8(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMeta) -> torch.Tensor:
        kq, vq, ks, vs = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        nd = meta.num_decode
        outs = []
        if nd:
            if self.kernel is not None:  # it stores k/v too
                out = self.kernel.decode_attention_int8(q[:nd].contiguous(), kq, vq, ks, vs, meta.decode_tables,
                                                        meta.decode_lens, meta.block_size, self.scale, k[:nd], v[:nd])
                outs.append(out.reshape(nd, -1))
            else:
                self._store_int8(layer, meta.decode_write_index, k[:nd], v[:nd])
                rows, plan = meta.compact_decode
                keys = dequantize_kv(kq[:, rows], ks[:, rows], self.dtype).transpose(0, 1)
                values = dequantize_kv(vq[:, rows], vs[:, rows], self.dtype).transpose(0, 1)
                outs.append(padded_attention(q[:nd], keys, values, plan, self.scale))
        row = nd
        for i in range(len(meta.tables) - nd):
            n, ctx = meta.query_lens[nd + i], meta.context_lens[nd + i]
            self._store_int8(layer, meta.prefill_write_index[i], k[row:row + n], v[row:row + n])
            rows = meta.prefill_key_rows[i]
            if self.prefill_kernel is not None:
                blocks = -(-(ctx + n) // meta.block_size)
                keys, values = self._dequantized(layer, rows, blocks * meta.block_size)
                o = self.prefill_kernel.prefill_attention(q[row:row + n], keys, values, torch.arange(blocks),
                                                          meta.block_size, ctx, self.scale)
            else:
                keys, values = self._dequantized(layer, rows, ctx + n)
                o = self._sdpa(q[row:row + n], keys, values, ctx)
            outs.append(o.reshape(n, -1))
            row += n
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]

    def _dequantized(self, layer: int, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (kv_heads, length, hd): pool rows ``rows`` dequantized, then zeros."""
        kq, vq, ks, vs = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        if self.dequantize_rows is not None:
            shape = (kq.shape[0], length, kq.shape[2])
            keys = torch.empty(shape, dtype=self.dtype, device=kq.device)
            values = torch.empty(shape, dtype=self.dtype, device=kq.device)
            self.dequantize_rows(kq, vq, ks, vs, rows, keys, values)
            return keys, values
        keys, values = dequantize_kv(kq[:, rows], ks[:, rows], self.dtype), dequantize_kv(vq[:, rows], vs[:, rows],
                                                                                             self.dtype)
        pad = length - rows.numel()
        if pad:
            keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
        return keys.contiguous(), values.contiguous()

    def _store_int8(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.store_int8 is not None:
            self.store_int8(k, self.k[layer], self.k_scale[layer], index)
            self.store_int8(v, self.v[layer], self.v_scale[layer], index)
            return
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = self.quantize(x)
            pool[layer][:, index] = q.transpose(0, 1)
            scales[layer][:, index] = s.transpose(0, 1)

    def _gathered(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
                  ctx: int) -> torch.Tensor:
        """A gather even over consecutive blocks: a strided view may take another SDPA path (other bits)."""
        return self._sdpa(q, kc[:, rows], vc[:, rows], ctx)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int) -> torch.Tensor:
        """q (n, heads, hd) over keys / values (kv_heads, ctx + n, hd)."""
        n = q.shape[0]
        qi = q.transpose(0, 1).unsqueeze(0)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        if n == 1:
            o = F.scaled_dot_product_attention(qi, keys, values, scale=self.scale, enable_gqa=True)
        elif ctx == 0:
            o = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            allowed = torch.arange(ctx + n, device=q.device)[None, :] <= (
                ctx + torch.arange(n, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=allowed, scale=self.scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1)


def single_prefill(cfg: DecoderConfig, tokens: int, device: torch.device, dtype: torch.dtype,
                   kv_dtype: str = "auto") -> tuple[KVPool, AttentionMeta]:
    """A pool for one sequence of ``tokens`` positions, and the metadata to prefill it at once."""
    pool = KVPool(cfg, -(-tokens // DEFAULT_BLOCK_TOKENS), device, dtype, kv_dtype=kv_dtype)
    table = pool.allocator.alloc(pool.allocator.num_blocks)
    assert table is not None
    return pool, pool.build_meta([table], [tokens], [0])
