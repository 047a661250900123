"""Pure decode steps replayed as CUDA graphs, one per (batch bucket, context bucket), over static buffers: the
rows' block tables are a graph input, so a graph replays whatever the block layout. Each graph's first replay
is checked against the eager forward. Without capture the same bucketed steps run eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import (
    DecodeRows,
    PinnedStaging,
    VarlenMeta,
    block_table,
    bucket_for,
    num_splits,
    pack,
    pad_decode,
)
from qasr.engine.runner import pick, read_back
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import Kernels

log = logging.getLogger(__name__)


class _Step:
    """One graph's static buffers: ``rows`` decode rows over at most ``max_k`` keys each."""

    def __init__(self, model: Qwen3ASRModel, pool: TokenKVPool, kernels: Kernels, rows: int, max_k: int,
                 splits: int, staging: PinnedStaging) -> None:
        self.model, self.pool, self.kernels, self.rows, self.max_k = model, pool, kernels, rows, max_k
        self.splits, self.staging = splits, staging
        dev = pool.device
        b, w = rows, max_k // pool.block_size
        self.i64 = torch.zeros(3 * b, dtype=torch.int64, device=dev)  # ids | positions | write rows
        self.i32 = torch.zeros(2 * b + 1 + b * w, dtype=torch.int32, device=dev)  # cu_k | used | block table
        self.ids, self.positions, self.write = self.i64[:b], self.i64[b:2 * b], self.i64[2 * b:]
        self.cu_k, self.used = self.i32[:b + 1], self.i32[b + 1:2 * b + 1]
        self.table = self.i32[2 * b + 1:].view(b, w)
        self.cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(b, dtype=torch.int64, device=dev)
        self.logprobs = torch.zeros(b, dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.verified = False
        self.load(pad_decode([0], [0], [[pool.scratch_block]], [0], b, pool.scratch_block))

    def meta(self, rows: DecodeRows) -> VarlenMeta:
        """The rows' metadata over the static buffers (the host tables serve the portable attention)."""
        b = self.rows
        return VarlenMeta(tuple(rows.tables), self.pool.block_size, (1,) * b,
                          tuple(rows.context_lens), b, self.cu_q, self.cu_k, self.used, self.table, self.write, 1,
                          self.max_k, self.splits)

    def load(self, rows: DecodeRows) -> None:
        """The rows into the static buffers; of the block table only the columns the rows use (the graph
        reads no further than each row's keys)."""
        bs, b = self.pool.block_size, self.rows
        ctx = np.asarray(rows.context_lens, dtype=np.int64)
        used = ctx + 1
        write = [t[c // bs] * bs + c % bs for t, c in zip(rows.tables, rows.context_lens, strict=True)]
        flat64, _ = pack([rows.ids, rows.positions, write], np.int64)
        flat32, _ = pack([np.concatenate([[0], np.cumsum(used)]), used], np.int32)
        width = -(-int(used.max()) // bs)
        self.staging.upload(flat64, out=self.i64)
        self.staging.upload(flat32, out=self.i32[:2 * b + 1])
        table = block_table(rows.tables, bs, used, width, pad=self.pool.scratch_block)
        self.staging.upload(table, out=self.table[:, :width])
        self._rows = rows

    def forward(self, meta: VarlenMeta) -> None:
        logits = self.model(self.ids, self.positions, self.pool, meta, kernels=self.kernels)
        tokens, logprobs = pick(logits)
        self.tokens.copy_(tokens)
        self.logprobs.copy_(logprobs)

    def capture(self, mempool: object) -> None:
        self._captured = self.meta(self._rows)
        self.graph = capture_graph(self.captured_forward, mempool)
        self.verified = False

    def captured_forward(self) -> None:
        self.forward(self._captured)

    def run(self, rows: DecodeRows) -> tuple[list[int], list[float]]:
        self.load(rows)
        n = rows.real
        if self.graph is None:
            self.forward(self.meta(rows))
        elif not self.verified:
            self.graph.replay()
            replayed = self.tokens.clone()
            self.forward(self.meta(rows))
            got, want, logprobs = torch.stack(
                [replayed[:n].double(), self.tokens[:n].double(), self.logprobs[:n].double()]).tolist()
            got, want = [int(t) for t in got], [int(t) for t in want]
            self.verified = True
            if got != want:
                raise ReplayMismatch(want, logprobs, f"bucket {self.rows} x {self.max_k} keys: the replay gave "
                                     f"{got}, the eager forward {want}")
            return want, logprobs
        else:
            self.graph.replay()
        return read_back(self.tokens[:n], self.logprobs[:n])


class ReplayMismatch(RuntimeError):
    """A replay disagreed with the eager forward; ``tokens`` and ``logprobs`` are the eager ones."""

    def __init__(self, tokens: list[int], logprobs: list[float], message: str) -> None:
        super().__init__(message)
        self.tokens, self.logprobs = tokens, logprobs


def capture_graph(forward: Callable[[], None], mempool: object) -> torch.cuda.CUDAGraph:
    """``forward`` warmed up on a side stream, then captured. Thread-local capture: another thread's
    synchronising call would otherwise spoil it. The tests replace this function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
        forward()
    return graph


class DecodeGraphs:
    """A step per (batch bucket, context bucket); ``slots`` (twice the SM count) sizes each one's key split."""

    def __init__(self, model: Qwen3ASRModel, pool: TokenKVPool, kernels: Kernels, buckets: Sequence[int],
                 context_buckets: Sequence[int], capture: bool, staging: PinnedStaging, slots: int) -> None:
        self.model, self.pool, self.kernels = model, pool, kernels
        self.buckets = tuple(buckets)
        self.context_buckets = tuple(context_buckets)
        self.capture = capture
        self.staging = staging
        self.slots = slots
        self.failed: str | None = None
        self._steps: dict[tuple[int, int], _Step] = {}
        self.steps = 0
        self.replays = 0
        self.capture_s = 0.0

    def key(self, rows: int, context_lens: Sequence[int]) -> tuple[int, int] | None:
        """The (batch bucket, context bucket) of a decode step, or None when no bucket holds it."""
        b = bucket_for(rows, self.buckets)
        k = bucket_for(max(context_lens) + 1, self.context_buckets)
        return None if b is None or k is None else (b, k)

    def run(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
            context_lens: Sequence[int]) -> tuple[list[int], list[float]] | None:
        """One pure decode step's tokens and log-probabilities, or None when no bucket holds it."""
        key = self.key(len(ids), context_lens)
        if key is None:
            return None
        self.prepare()
        step = self._steps[key]
        replayed = step.graph is not None
        try:
            sampled = step.run(pad_decode(ids, positions, tables, context_lens, key[0], self.pool.scratch_block))
        except ReplayMismatch as exc:
            self.disable(str(exc))
            log.warning("qasr: a replayed decode graph disagreed with the eager forward (%s); decode steps run "
                        "eagerly", exc)
            sampled, replayed = (exc.tokens, exc.logprobs), False
        self.steps += 1
        self.replays += replayed
        return sampled

    def disable(self, why: str) -> None:
        self.failed = why
        for step in self._steps.values():
            step.graph = None

    def prepare(self) -> None:
        """Static buffers for every bucket and, with ``capture``, a graph each (largest first, one memory
        pool); a failed capture leaves them eager, with a warning. Runs once."""
        if self._steps:
            return
        t0 = time.perf_counter()
        kv_heads = self.pool.k.shape[-2]
        self._steps = {(b, k): _Step(self.model, self.pool, self.kernels, b, k,
                                     num_splits(b, kv_heads, k, self.slots), self.staging)
                       for b in self.buckets for k in self.context_buckets}
        if not self.capture:
            return
        try:
            mempool = torch.cuda.graph_pool_handle()
            for key in sorted(self._steps, reverse=True):
                self._steps[key].capture(mempool)
            self._check()
        except Exception as exc:  # noqa: BLE001
            self.disable(repr(exc))
            log.warning("qasr: capturing decode graphs failed (%r); decode steps run eagerly", exc)
        self.capture_s = time.perf_counter() - t0

    def _check(self) -> None:
        step = self._steps[(self.buckets[0], self.context_buckets[0])]
        rows = step._rows
        step.load(rows)
        step.graph.replay()
        replayed = step.tokens.clone()
        step.forward(step.meta(rows))
        if not torch.equal(replayed, step.tokens):
            raise RuntimeError("a replayed decode graph gave other tokens than the eager forward")
