"""Host-side planning for the CUDA backend: a forward's attention metadata (block tables, which flash's paged path
reads the pool through), the buckets decode graphs are captured for, and uploads through reused pinned staging."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from qasr.engine.cuda.fallback import FallbackPlan, fallback_plan
from qasr.engine.kv_blocks import token_rows

FLASH_BLOCK_TOKENS = 256  # flash's paged path reads KV blocks of a multiple of this many tokens
SPLIT_KEYS = 128  # the fewest keys per part when a decode graph's attention splits a sequence's keys


@dataclass(frozen=True)
class VarlenHost:
    """One packed forward's attention metadata on the host (S sequences, N query rows)."""

    cu_q: np.ndarray  # (S + 1,) int32: query rows of sequence b are [cu_q[b], cu_q[b + 1])
    cu_k: np.ndarray  # (S + 1,) int32: cumulative used_k (the op's argument; with a block table it locates nothing)
    used_k: np.ndarray  # (S,) int32: context + new tokens
    block_table: np.ndarray  # (S, W) int32: sequence b's blocks, padded with 0 (never read past used_k)
    write_index: np.ndarray  # (N,) int64: pool row of each new key and value
    max_q: int
    max_k: int


def block_table(tables: Sequence[Sequence[int]], block_size: int, used: Sequence[int], width: int,
                pad: int = 0) -> np.ndarray:
    """(S, width) int32: each sequence's first ceil(used / block_size) blocks, then ``pad``."""
    counts = -(-np.asarray(used, dtype=np.int64) // block_size)
    flat = np.fromiter(itertools.chain.from_iterable(t[:n] for t, n in zip(tables, counts.tolist(), strict=True)),
                       dtype=np.int32, count=int(counts.sum()))
    out = np.full((len(tables), width), pad, dtype=np.int32)
    out[np.arange(width) < counts[:, None]] = flat  # row by row, in position order
    return out


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
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    if (lens * block_size < used).any():
        b = int(np.argmax(lens * block_size < used))
        raise ValueError(f"a block table of {lens[b]} blocks cannot hold {used[b]} positions")
    cu_q = np.zeros(len(ql) + 1, dtype=np.int32)
    np.cumsum(ql, out=cu_q[1:])
    cu_k = np.zeros(len(ql) + 1, dtype=np.int32)
    np.cumsum(used, out=cu_k[1:])
    write = np.concatenate([[t[c // block_size] * block_size + c % block_size] if n == 1  # a decode row
                            else token_rows(t, block_size, c, c + n)
                            for t, n, c in zip(tables, ql.tolist(), ctx.tolist(), strict=True)]).astype(np.int64)
    table = block_table(tables, block_size, used, -(-int(used.max()) // block_size))
    if (table < 0).any():
        raise ValueError("block ids must be >= 0")
    return VarlenHost(cu_q, cu_k, used.astype(np.int32), table, write, int(ql.max()), int(used.max()))


@dataclass(frozen=True)
class VarlenMeta:
    """``VarlenHost`` on the device, what ``TokenKVPool.attend`` reads. A decode graph passes its context
    bucket as ``max_k`` and the parts it splits each sequence's keys into as ``num_splits`` (None: the op's
    own choice from ``max_k``)."""

    tables: tuple[Sequence[int], ...]  # on the host, for the portable attention
    block_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_decode: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    block_table: torch.Tensor
    write_index: torch.Tensor
    max_q: int
    max_k: int
    num_splits: int | None = None

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


def context_buckets(capacity: int, block_size: int, first: int = 2048, factor: int = 4) -> tuple[int, ...]:
    """Key-count ceilings of decode graphs, whole blocks each: ``first``, ``first * factor``, ... below
    ``capacity`` (the most keys a sequence can have), then ``capacity``."""
    if capacity < 1 or block_size < 1:
        raise ValueError("capacity and block_size must be >= 1")
    top = -(-capacity // block_size) * block_size
    out, k = [], -(-first // block_size) * block_size
    while k < top:
        out.append(k)
        k *= factor
    return (*out, top)


def num_splits(sequences: int, kv_heads: int, max_k: int, slots: int) -> int:
    """The parts a decode graph's attention splits each sequence's keys (up to ``max_k``) into: one where
    the (sequence, kv head) tasks fill ``slots`` (twice the SM count), else enough parts to fill them, at
    least ``SPLIT_KEYS`` keys each and at most 128."""
    tasks = sequences * kv_heads
    if 5 * tasks >= 4 * slots:
        return 1
    return max(1, min(128, slots // tasks, -(-max_k // SPLIT_KEYS)))


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows padded to a bucket; pad rows use only the pool's scratch block."""

    ids: list[int]
    positions: list[int]
    tables: list[Sequence[int]]
    context_lens: list[int]
    real: int  # rows before the padding


def pad_decode(ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
               context_lens: Sequence[int], bucket: int, scratch_block: int) -> DecodeRows:
    n = len(ids)
    if not (n == len(positions) == len(tables) == len(context_lens)) or not 0 < n <= bucket:
        raise ValueError(f"{n} decode rows do not fit a bucket of {bucket}")
    pad = bucket - n
    return DecodeRows([*ids, *[0] * pad], [*positions, *[0] * pad], [*tables, *[[scratch_block]] * pad],
                      [*context_lens, *[0] * pad], n)


def pack(arrays: Sequence[Sequence[int] | np.ndarray], dtype: np.dtype) -> tuple[np.ndarray, list[tuple[int, int]]]:
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
    spans, offset = [], 0
    for p in parts:
        spans.append((offset, p.size))
        offset += p.size
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return flat.astype(dtype, copy=False), spans


class PinnedStaging:
    """Host memory for asynchronous uploads, reused: pinned on CUDA (a copy from pageable memory syncs the
    stream), grown when too small, never given back. Uploads take consecutive regions of the current buffer
    (a step's uploads share one); a full buffer is started over only once the last copy that read it has run
    (a CUDA event, queried without waiting), else another buffer is taken or added."""

    ALIGN = 64  # region offsets, so any dtype's view is aligned

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._buffers: list[list] = []  # [uint8 buffer, bytes taken, event of the last copy that read it | None]
        self._current = -1

    @property
    def nbytes(self) -> int:
        return sum(b[0].numel() for b in self._buffers)

    def _region(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """(buffer index, offset) of ``nbytes`` that no queued copy reads."""
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if self._current >= 0:
            buf = self._buffers[self._current]
            if buf[1] + size <= buf[0].numel():
                buf[1] += size
                return self._current, buf[1] - size
        free = [i for i, (_, _, ev) in enumerate(self._buffers) if ev is None or ev.query()]
        fits = [i for i in free if self._buffers[i][0].numel() >= size]
        if fits:
            i = min(fits, key=lambda i: self._buffers[i][0].numel())
        else:
            largest = max((self._buffers[i][0].numel() for i in free), default=2048)
            grown = torch.empty(max(2 * largest, 1 << (size - 1).bit_length()), dtype=torch.uint8,
                                pin_memory=self.device.type == "cuda")
            if free:  # the largest free buffer gives way to a larger one
                i = max(free, key=lambda i: self._buffers[i][0].numel())
                self._buffers[i] = [grown, 0, None]
            else:
                self._buffers.append([grown, 0, None])
                i = len(self._buffers) - 1
        self._current = i
        self._buffers[i][1] = size
        return i, 0

    def upload(self, host: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` on the device, into ``out`` when given, the copy queued on the current stream."""
        src = torch.as_tensor(host).contiguous()
        nbytes = src.numel() * src.element_size()
        i, offset = self._region(nbytes)
        buf = self._buffers[i]
        staged = buf[0][offset:offset + nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        if out is None:
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        out.copy_(staged, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            buf[2] = torch.cuda.Event()
            buf[2].record()
        return out


def upload(staging: PinnedStaging, arrays: Sequence[Sequence[int] | np.ndarray],
           dtype: torch.dtype) -> list[torch.Tensor]:
    """Small integer arrays to the device in one asynchronous copy, returned as views of it."""
    np_dtype = {torch.int32: np.int32, torch.int64: np.int64}[dtype]
    flat, spans = pack(arrays, np_dtype)
    dev = staging.upload(flat)
    return [dev[o:o + n] for o, n in spans]


def upload_meta(staging: PinnedStaging, tables: Sequence[Sequence[int]], block_size: int,
                query_lens: Sequence[int], context_lens: Sequence[int], num_decode: int,
                *ride_along: Sequence[int] | np.ndarray) -> tuple[VarlenMeta, list[torch.Tensor]]:
    """One packed forward's ``VarlenMeta`` on the device in one int32 and one int64 copy; ``ride_along``
    int64 arrays travel in the latter and are returned on the device, in order."""
    host = varlen_host(tables, block_size, query_lens, context_lens)
    cu_q, cu_k, used, flat_table = upload(staging, [host.cu_q, host.cu_k, host.used_k, host.block_table], torch.int32)
    *extra, write = upload(staging, [*ride_along, host.write_index], torch.int64)
    meta = VarlenMeta(tuple(tables), block_size, tuple(query_lens), tuple(context_lens),
                      num_decode, cu_q, cu_k, used, flat_table.view(host.block_table.shape), write, host.max_q,
                      host.max_k)
    return meta, extra
