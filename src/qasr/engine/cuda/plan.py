"""Host-side planning for the CUDA backend: varlen attention metadata, decode-batch buckets, uploads.
Flash reads the pool in place where every sequence's blocks are consecutive, else a gathered copy (its
paged path would need 256-token blocks)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from qasr.engine.cuda.fallback import FallbackPlan, fallback_plan
from qasr.engine.kv_blocks import contiguous_start, token_rows


@dataclass(frozen=True)
class VarlenHost:
    """One packed forward's attention metadata on the host (S sequences, N query rows)."""

    cu_q: np.ndarray  # (S + 1,) int32: query rows of sequence b are [cu_q[b], cu_q[b + 1])
    k_starts: np.ndarray  # (S + 1,) int32: first key row of each sequence; the last is never read
    used_k: np.ndarray  # (S,) int32: context + new tokens
    write_index: np.ndarray  # (N,) int64: pool row of each new key and value
    gather: np.ndarray | None  # (sum(used_k),) int64 pool rows to stage, or None
    max_q: int
    max_k: int


def varlen_host(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                context_lens: Sequence[int]) -> VarlenHost:
    """Sequence b brings query_lens[b] tokens after context_lens[b], in the blocks tables[b]."""
    if not (len(tables) == len(query_lens) == len(context_lens)) or not tables:
        raise ValueError("one block table, query length and context length per sequence, at least one sequence")
    ql = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    if (ql < 1).any() or (ctx < 0).any():
        raise ValueError("query lengths must be >= 1, context lengths >= 0")
    used = ctx + ql
    for t, u in zip(tables, used.tolist(), strict=True):
        if len(t) * block_size < u or min(t, default=0) < 0:
            raise ValueError(f"a block table of {len(t)} blocks cannot hold {u} positions")
    cu_q = np.zeros(len(ql) + 1, dtype=np.int32)
    np.cumsum(ql, out=cu_q[1:])
    write = np.concatenate([token_rows(t, block_size, c, c + n)
                            for t, n, c in zip(tables, ql.tolist(), ctx.tolist(), strict=True)])
    starts = [contiguous_start(t, block_size, u) for t, u in zip(tables, used.tolist(), strict=True)]
    k_starts = np.zeros(len(ql) + 1, dtype=np.int32)
    gather = None
    if all(s is not None for s in starts):
        k_starts[:-1] = starts
    else:
        k_starts[1:] = np.cumsum(used)
        gather = np.concatenate([token_rows(t, block_size, 0, u) for t, u in zip(tables, used.tolist(), strict=True)])
    return VarlenHost(cu_q, k_starts, used.astype(np.int32), write, gather, int(ql.max()), int(used.max()))


@dataclass(frozen=True)
class VarlenMeta:
    """``VarlenHost`` on the device, what ``TokenKVPool.attend`` reads. A decode graph passes the pool's
    capacity as ``max_k``, so one graph serves any context length."""

    tables: tuple[tuple[int, ...], ...]
    block_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_decode: int
    cu_q: torch.Tensor
    k_starts: torch.Tensor
    used_k: torch.Tensor
    write_index: torch.Tensor
    gather: torch.Tensor | None
    max_q: int
    max_k: int

    @cached_property
    def fallback(self) -> FallbackPlan:
        return fallback_plan(self.tables, self.block_size, self.query_lens, self.context_lens, self.cu_q.device)


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """Decode batch sizes to capture: 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, ... up to the first >= max_rows."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    sizes = [1, 2, 4, 6, 8]
    p = 8
    while sizes[-1] < max_rows:
        sizes += [p + p // 2, 2 * p]
        p *= 2
    out = [s for s in sizes if s < max_rows]
    return (*out, next(s for s in sizes if s >= max_rows))


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows padded to a bucket; pad rows use only the pool's scratch row."""

    ids: list[int]
    positions: list[int]
    starts: list[int]
    context_lens: list[int]
    real: int  # rows before the padding


def pad_decode(ids: Sequence[int], positions: Sequence[int], starts: Sequence[int], context_lens: Sequence[int],
               bucket: int, scratch: int) -> DecodeRows:
    n = len(ids)
    if not (n == len(positions) == len(starts) == len(context_lens)) or not 0 < n <= bucket:
        raise ValueError(f"{n} decode rows do not fit a bucket of {bucket}")
    pad = bucket - n
    return DecodeRows([*ids, *[0] * pad], [*positions, *[0] * pad], [*starts, *[scratch] * pad],
                      [*context_lens, *[0] * pad], n)


def pack(arrays: Sequence[Sequence[int] | np.ndarray], dtype: np.dtype) -> tuple[np.ndarray, list[tuple[int, int]]]:
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
    spans, offset = [], 0
    for p in parts:
        spans.append((offset, p.size))
        offset += p.size
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return flat.astype(dtype, copy=False), spans


def upload(arrays: Sequence[Sequence[int] | np.ndarray], dtype: torch.dtype,
           device: torch.device) -> list[torch.Tensor]:
    """Small integer arrays to the device in one asynchronous copy (pinned, on CUDA: a copy from pageable
    memory would sync the stream), returned as views of it."""
    np_dtype = {torch.int32: np.int32, torch.int64: np.int64}[dtype]
    flat, spans = pack(arrays, np_dtype)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    return [dev[o:o + n] for o, n in spans]


def upload_meta(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                context_lens: Sequence[int], num_decode: int, device: torch.device,
                *ride_along: Sequence[int] | np.ndarray) -> tuple[VarlenMeta, list[torch.Tensor]]:
    """One packed forward's ``VarlenMeta`` on ``device`` in one int32 and one int64 copy; ``ride_along``
    int64 arrays travel in the latter and are returned on the device, in order."""
    host = varlen_host(tables, block_size, query_lens, context_lens)
    cu_q, k_starts, used = upload([host.cu_q, host.k_starts, host.used_k], torch.int32, device)
    staged = [] if host.gather is None else [host.gather]
    *extra, write = upload([*ride_along, *staged, host.write_index], torch.int64, device)
    gather = extra.pop() if staged else None
    meta = VarlenMeta(tuple(tuple(t) for t in tables), block_size, tuple(query_lens), tuple(context_lens),
                      num_decode, cu_q, k_starts, used, write, gather, host.max_q, host.max_k)
    return meta, extra
