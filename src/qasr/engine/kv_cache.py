"""The CPU KV cache: one token pool per layer, allocated once, handed out in fixed-size blocks.

Per layer one ``(kv_heads, num_blocks * block_size, head_dim)`` tensor for keys and one for values. A
request holds a block table (engine/kv_blocks.py): its positions live block by block anywhere in the
pool, in order within a block. The native kernels read through the table (a loop over blocks, each a
contiguous run of ``block_size`` keys per head: 16 KB at head_dim 128 in bf16 with 64-token blocks, long
enough for the hardware prefetchers to stream; 4 KB runs of 16-token blocks cost decode attention up to
60% more when the blocks are scattered); the torch fallbacks gather the rows the table names.

With ``kv_dtype="int8"`` (EngineConfig.kv_cache_dtype) the pool holds int8 keys and values with one float32
scale per (token, kv head) (engine/kv_quant.py): 132 bytes a row at head_dim 128 instead of 256. The native
decode kernel reads it in place (half the bytes a decode step streams); prefill chunks and the torch fallbacks
read their sequence's rows dequantized to the model's dtype and run the plain paths over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from qasr.engine.kv_blocks import BlockAllocator, token_rows
from qasr.engine.kv_quant import KV_CACHE_DTYPES, dequantize_kv, quantizer, row_dequantizer
from qasr.engine.padded_attention import PaddedPlan, padded_attention, padded_plan
from qasr.model.config import DecoderConfig

DEFAULT_BLOCK_TOKENS = 64  # EngineConfig.kv_block_tokens' default (docs/engine.md: why)


@dataclass(frozen=True)
class AttentionMeta:
    """Where each packed sequence lives in this pool and how many tokens it brings: the metadata
    ``KVPool.attend`` reads for one forward (the model passes it through unread).

    Sequences that bring exactly one token (decode) come first; the tensors every layer reads are built
    once per forward here, so the cache does no host work per layer.
    """

    tables: tuple[tuple[int, ...], ...]  # block ids of each sequence, in position order
    block_size: int
    query_lens: tuple[int, ...]  # new tokens per sequence in this forward
    context_lens: tuple[int, ...]  # tokens already cached per sequence before this forward
    num_decode: int  # leading sequences with exactly one new token
    decode_tables: torch.Tensor  # (num_decode, widest table) int64, padded with block 0 (never read)
    decode_lens: torch.Tensor  # (num_decode,) tokens attended (context + 1)
    decode_write_index: torch.Tensor  # (num_decode,) pool row of the new token
    prefill_tables: tuple[torch.Tensor, ...]  # per prefill sequence: its block table, int64
    prefill_write_index: tuple[torch.Tensor, ...]  # per prefill sequence: pool rows of its new tokens

    @classmethod
    def build(cls, tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
              context_lens: Sequence[int], device: torch.device, num_decode: int = 0) -> AttentionMeta:
        """``num_decode``: how many leading sequences are decode steps. A one-token prefill chunk is
        not counted among them even when it follows the decode rows: it must take the prefill path in
        every batch, or its result would depend on whether other chunks precede it."""
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
        """The decode rows' gather plan for the portable attention, built once per forward on first use."""
        nd = self.num_decode
        assert nd, "only decode rows take the padded path"
        return padded_plan(self.tables[:nd], self.block_size, self.query_lens[:nd], self.context_lens[:nd],
                           self.decode_lens.device)

    @cached_property
    def compact_decode(self) -> tuple[torch.Tensor, PaddedPlan]:
        """For an int8 pool without the native kernel: the distinct pool rows the decode rows read, and the
        padded plan over those rows laid out compactly (row i of the dequantized copy is pool row rows[i])."""
        plan = self.padded
        rows, inverse = torch.unique(plan.k_index, sorted=True, return_inverse=True)
        return rows, replace(plan, k_index=inverse)

    @cached_property
    def prefill_key_rows(self) -> tuple[torch.Tensor, ...]:
        """Per prefill sequence: the pool rows of all its keys (context + new), for the torch fallback."""
        nd = self.num_decode
        return tuple(torch.from_numpy(token_rows(t, self.block_size, 0, c + n)).to(self.decode_lens.device)
                     for t, n, c in zip(self.tables[nd:], self.query_lens[nd:], self.context_lens[nd:], strict=True))


def kv_bytes_per_token(cfg: DecoderConfig, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Bytes of KV memory one token takes over all layers: keys and values in ``dtype``, or with
    ``kv_dtype="int8"`` one byte a value plus a float32 scale per kv head."""
    rows = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
    if kv_dtype == "int8":
        return rows * (cfg.head_dim + 4)
    return rows * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(self, cfg: DecoderConfig, num_blocks: int, device: torch.device, dtype: torch.dtype, *,
                 block_size: int = DEFAULT_BLOCK_TOKENS, decode_kernel: ModuleType | None = None,
                 prefill_kernel: ModuleType | None = None, kv_dtype: str = "auto") -> None:
        """``decode_kernel`` / ``prefill_kernel``: native attention modules chosen by engine/device.py
        (None: torch's SDPA, same maths). ``kv_dtype``: "auto" stores keys and values in ``dtype``, "int8"
        as int8 with scales (engine/kv_quant.py)."""
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.tokens = tokens = num_blocks * block_size
        self.dtype = dtype  # what attention computes in (an int8 pool's values are read as this dtype)
        self.int8 = kv_dtype == "int8"
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, tokens, cfg.head_dim)
        # empty, not zeros: every slot is written before it is read, and untouched pages cost no RAM
        store = torch.int8 if self.int8 else dtype
        self.k = torch.empty(shape, device=device, dtype=store)
        self.v = torch.empty(shape, device=device, dtype=store)
        if self.int8:
            self.k_scale = torch.empty(shape[:-1], device=device, dtype=torch.float32)
            self.v_scale = torch.empty(shape[:-1], device=device, dtype=torch.float32)
            self.quantize = quantizer(decode_kernel)
            self.dequantize_rows = row_dequantizer(decode_kernel, dtype)
            # the native one-pass store takes the activations' dtypes the kernel takes (as row_dequantizer)
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
        """The metadata ``attend`` reads for one packed forward (each pool layout builds its own)."""
        return AttentionMeta.build(tables, self.block_size, query_lens, context_lens, self.k.device,
                                   num_decode=num_decode)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMeta) -> torch.Tensor:
        """q (N, heads, hd), k/v (N, kv_heads, hd) -> (N, heads * hd).

        Rows are ordered: first ``meta.num_decode`` single-token sequences, then prefill chunks.
        """
        if self.int8:
            return self._attend_int8(layer, q, k, v, meta)
        kc, vc = self.k[layer], self.v[layer]
        nd = meta.num_decode
        outs = []
        if nd:
            if self.kernel is not None:  # the kernel also stores the new keys/values
                out = self.kernel.decode_attention(q[:nd].contiguous(), kc, vc, meta.decode_tables, meta.decode_lens,
                                                   meta.block_size, self.scale, k[:nd], v[:nd])
                outs.append(out.reshape(nd, -1))
            else:
                idx = meta.decode_write_index
                kc[:, idx] = k[:nd].transpose(0, 1)
                vc[:, idx] = v[:nd].transpose(0, 1)
                # the portable path (GPUs, or CPUs without the kernel), over the pool seen token-major
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
        """``attend`` over the int8 pool: the new rows quantized and stored, then attention over the stored
        values (the new tokens' own keys included, as stored), so a row reads the same keys whether they
        came in this forward or an earlier one."""
        kq, vq, ks, vs = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        nd = meta.num_decode
        outs = []
        if nd:
            if self.kernel is not None:  # it quantizes and stores the new keys/values itself
                out = self.kernel.decode_attention_int8(q[:nd].contiguous(), kq, vq, ks, vs, meta.decode_tables,
                                                        meta.decode_lens, meta.block_size, self.scale, k[:nd], v[:nd])
                outs.append(out.reshape(nd, -1))
            else:
                self._store_int8(layer, meta.decode_write_index, k[:nd], v[:nd])
                rows, plan = meta.compact_decode
                keys = dequantize_kv(kq[:, rows], ks[:, rows], self.dtype).transpose(0, 1)  # (rows, kv_heads, hd)
                values = dequantize_kv(vq[:, rows], vs[:, rows], self.dtype).transpose(0, 1)
                outs.append(padded_attention(q[:nd], keys, values, plan, self.scale))
        row = nd
        for i in range(len(meta.tables) - nd):
            n, ctx = meta.query_lens[nd + i], meta.context_lens[nd + i]
            self._store_int8(layer, meta.prefill_write_index[i], k[row:row + n], v[row:row + n])
            rows = meta.prefill_key_rows[i]  # the sequence's ctx + n positions, in order
            if self.prefill_kernel is not None:
                # the kernel reads a pool of whole blocks through a table: the dequantized rows as one
                # sequence in consecutive blocks, zeros after (its result does not depend on where blocks lie)
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
        """Keys and values (kv_heads, length, hd) in the model's dtype: pool rows ``rows`` dequantized, zeros after
        them. The native kernel does it in one pass (the torch gather + dequantize + pad took longer than the
        prefill attention that reads them: 7-9 against 6 ms a layer at 1,024 positions); both give the same bits."""
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
        """Quantize (n, kv_heads, hd) new keys and values and store them at pool rows ``index``: in one native pass
        each where the decode kernel has it (the same bits as the torch ops below, which took 1.2 ms a layer at a
        512-token chunk of the 0.6B decoder)."""
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
        """The torch fallback: attention of n new tokens (already written) over the sequence's first
        ctx + n tokens, gathered from the rows its block table names. Always a gather, even where the
        blocks happen to be consecutive, so SDPA sees the same contiguous input wherever the blocks lie
        (a strided view might take another SDPA path and round differently)."""
        return self._sdpa(q, kc[:, rows], vc[:, rows], ctx)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int) -> torch.Tensor:
        """q (n, heads, hd) new tokens over keys / values (kv_heads, ctx + n, hd) of their sequence."""
        n = q.shape[0]
        qi = q.transpose(0, 1).unsqueeze(0)  # (1, heads, n, hd)
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
    """A pool just large enough for one sequence of ``tokens`` positions and the metadata of prefilling
    all of them in one forward (reference computations and benchmarks that run the model without an engine)."""
    pool = KVPool(cfg, -(-tokens // DEFAULT_BLOCK_TOKENS), device, dtype, kv_dtype=kv_dtype)
    table = pool.allocator.alloc(pool.allocator.num_blocks)
    assert table is not None
    return pool, pool.build_meta([table], [tokens], [0])
