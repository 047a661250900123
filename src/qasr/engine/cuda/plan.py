"""Host-side planning for the CUDA backend: varlen attention metadata, decode-batch buckets, uploads.

Everything here is pure bookkeeping on host integers (tested on CPU); the tensors it produces are what
the varlen attention kernel and the captured decode graphs read on the device.

The KV pool is token-major, ``(layers, tokens + 1, kv_heads, head_dim)``, handed out in blocks
(engine/kv_blocks.py): a sequence's position p is row ``table[p // bs] * bs + p % bs`` of one layer's
``(tokens + 1, kv_heads, head_dim)`` slab. Flash varlen reads packed keys: each sequence's key offset
from ``cu_seqlens_k[b]`` and, when ``seqused_k`` is given, its length from ``seqused_k[b]``
(``cu_seqlens_k[b + 1]`` is then never read), so sequences need not be adjacent or ordered. Two cases:

- every sequence's blocks of this step are consecutive (the allocator hands out lowest ids first, so
  this is the common case on a pool that is not fragmented): ``k_starts`` holds each sequence's first
  row and flash reads the pool in place, no gather;
- some sequence's blocks are scattered: ``gather`` lists the pool rows of every sequence's keys, in
  position order, the attention copies them into a contiguous staging buffer per layer (one
  ``index_select``) and ``k_starts`` are offsets in it. (torch's flash op takes a block table, but its
  paged path needs blocks of 256 tokens; a gather costs one pass over the keys, which a GPU's bandwidth
  absorbs.)

Causal masking is aligned at the bottom right, so query row i of a chunk of n new tokens over ctx cached
ones sees keys [0, ctx + i]: decode rows (n = 1) and prefill chunks with or without a cached prefix go
through one call.
"""

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
    """The host-side arrays of one packed forward's attention metadata (S sequences, N query rows)."""

    cu_q: np.ndarray  # (S + 1,) int32: query rows of sequence b are [cu_q[b], cu_q[b + 1])
    k_starts: np.ndarray  # (S + 1,) int32: first key row of each sequence (pool or staging); the last never read
    used_k: np.ndarray  # (S,) int32: keys each sequence attends (context + new tokens)
    write_index: np.ndarray  # (N,) int64: pool row of each query row's new key and value
    gather: np.ndarray | None  # (sum(used_k),) int64 pool rows to stage, or None: read the pool in place
    max_q: int
    max_k: int


def varlen_host(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                context_lens: Sequence[int]) -> VarlenHost:
    """Metadata for sequences whose new tokens are packed in order: sequence b brings query_lens[b]
    tokens at positions context_lens[b].. and keeps its positions in the blocks tables[b]."""
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
    """What ``TokenKVPool.attend`` reads for one packed forward (the device twin of ``VarlenHost``).

    ``max_k`` is the longest key range for an eager call; a captured decode graph passes the pool's
    capacity instead, so the same graph serves any context length."""

    tables: tuple[tuple[int, ...], ...]
    block_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_decode: int
    cu_q: torch.Tensor  # (S + 1,) int32
    k_starts: torch.Tensor  # (S + 1,) int32
    used_k: torch.Tensor  # (S,) int32
    write_index: torch.Tensor  # (N,) int64
    gather: torch.Tensor | None  # pool rows to stage for flash; None: flash reads the pool in place
    max_q: int
    max_k: int

    @cached_property
    def fallback(self) -> FallbackPlan:
        """The groups of the portable (reference) attention, planned once per forward on first use."""
        return fallback_plan(self.tables, self.block_size, self.query_lens, self.context_lens, self.cu_q.device)


# ------------------------------------------------------------------------------------------ decode buckets
def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, 6, 8, then powers of two and the points half
    way between them (12, 16, 24, 32, 48, ...), up to the first size >= max_rows. A batch is padded to
    the next bucket, so padding stays under a third of the rows."""
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
    """The smallest bucket holding ``rows`` rows; None when the batch is larger than every bucket."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows, padded to a bucket. Pad rows read and write only the pool's scratch row."""

    ids: list[int]
    positions: list[int]
    starts: list[int]
    context_lens: list[int]
    real: int  # the first ``real`` rows are the batch's own


def pad_decode(ids: Sequence[int], positions: Sequence[int], starts: Sequence[int], context_lens: Sequence[int],
               bucket: int, scratch: int) -> DecodeRows:
    n = len(ids)
    if not (n == len(positions) == len(starts) == len(context_lens)) or not 0 < n <= bucket:
        raise ValueError(f"{n} decode rows do not fit a bucket of {bucket}")
    pad = bucket - n
    return DecodeRows([*ids, *[0] * pad], [*positions, *[0] * pad], [*starts, *[scratch] * pad],
                      [*context_lens, *[0] * pad], n)


# ------------------------------------------------------------------------------------------------ uploads
def pack(arrays: Sequence[Sequence[int] | np.ndarray], dtype: np.dtype) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Concatenate integer arrays into one host buffer; returns it and each array's (offset, length)."""
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
    spans, offset = [], 0
    for p in parts:
        spans.append((offset, p.size))
        offset += p.size
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return flat.astype(dtype, copy=False), spans


def upload(arrays: Sequence[Sequence[int] | np.ndarray], dtype: torch.dtype,
           device: torch.device) -> list[torch.Tensor]:
    """Several small integer arrays to the device in ONE copy, returned as views of the copy.

    On CUDA the buffer goes through pinned memory and the copy is asynchronous: a plain ``torch.tensor(...,
    device='cuda')`` from pageable memory synchronises the stream, i.e. waits for all queued GPU work.
    Pinned blocks come from torch's caching host allocator, which keeps a block until the copies that
    read it have run, so the host buffer may be reused at once."""
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
    """One packed forward's ``VarlenMeta`` on ``device``, in one int32 copy and one int64 copy.

    ``ride_along``: other per-step int64 arrays (the runner's ids, positions, logit rows, audio rows) that
    travel in the same int64 copy as the write rows (and the gather rows), returned on the device in
    order; so a step uploads once per dtype."""
    host = varlen_host(tables, block_size, query_lens, context_lens)
    cu_q, k_starts, used = upload([host.cu_q, host.k_starts, host.used_k], torch.int32, device)
    staged = [] if host.gather is None else [host.gather]
    *extra, write = upload([*ride_along, *staged, host.write_index], torch.int64, device)
    gather = extra.pop() if staged else None
    meta = VarlenMeta(tuple(tuple(t) for t in tables), block_size, tuple(query_lens), tuple(context_lens),
                      num_decode, cu_q, k_starts, used, write, gather, host.max_q, host.max_k)
    return meta, extra
