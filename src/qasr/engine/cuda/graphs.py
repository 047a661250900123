"""Pure decode steps replayed as CUDA graphs, one per batch bucket, over static buffers; each graph's first
replay is checked against the eager forward. Without capture the same bucketed steps run eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import DecodeRows, VarlenMeta, bucket_for, pack, pad_decode
from qasr.engine.runner import pick, read_back
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import Kernels

log = logging.getLogger(__name__)


def _host(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(flat)
    return t.pin_memory() if device.type == "cuda" else t


class _Step:

    def __init__(self, model: Qwen3ASRModel, pool: TokenKVPool, kernels: Kernels, rows: int) -> None:
        self.model, self.pool, self.kernels, self.rows = model, pool, kernels, rows
        dev = pool.device
        b = rows
        self.i64 = torch.zeros(3 * b, dtype=torch.int64, device=dev)  # ids | positions | write rows
        self.i32 = torch.zeros(2 * b + 1, dtype=torch.int32, device=dev)  # k_starts (b + 1) | used (b)
        self.ids, self.positions, self.write = self.i64[:b], self.i64[b:2 * b], self.i64[2 * b:]
        self.k_starts, self.used = self.i32[:b + 1], self.i32[b + 1:]
        self.cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(b, dtype=torch.int64, device=dev)
        self.logprobs = torch.zeros(b, dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.verified = False
        self.load(pad_decode([0], [0], [pool.scratch], [0], b, pool.scratch))

    def meta(self, rows: DecodeRows) -> VarlenMeta:
        """The rows' metadata over the static buffers; a row's blocks are consecutive from its first row."""
        b, bs = self.rows, self.pool.block_size
        tables = tuple(tuple(range(s // bs, s // bs + c // bs + 1)) for s, c in zip(rows.starts, rows.context_lens,
                                                                                    strict=True))
        return VarlenMeta(tables, bs, (1,) * b, tuple(rows.context_lens), b, self.cu_q, self.k_starts, self.used,
                          self.write, None, 1, self.pool.tokens + 1)

    def load(self, rows: DecodeRows) -> None:
        st = np.asarray(rows.starts, dtype=np.int64)
        ctx = np.asarray(rows.context_lens, dtype=np.int64)
        dev = self.pool.device
        flat64, _ = pack([rows.ids, rows.positions, st + ctx], np.int64)
        flat32, _ = pack([st, [0], ctx + 1], np.int32)
        self.i64.copy_(_host(flat64, dev), non_blocking=True)
        self.i32.copy_(_host(flat32, dev), non_blocking=True)
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
                raise ReplayMismatch(want, logprobs, f"bucket {self.rows}: the replay gave {got}, "
                                     f"the eager forward {want}")
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
    def __init__(self, model: Qwen3ASRModel, pool: TokenKVPool, kernels: Kernels, buckets: Sequence[int],
                 capture: bool) -> None:
        self.model, self.pool, self.kernels = model, pool, kernels
        self.buckets = tuple(buckets)
        self.capture = capture
        self.failed: str | None = None
        self._steps: dict[int, _Step] = {}
        self.steps = 0
        self.replays = 0
        self.capture_s = 0.0

    def run(self, ids: Sequence[int], positions: Sequence[int], starts: Sequence[int],
            context_lens: Sequence[int]) -> tuple[list[int], list[float]] | None:
        """One pure decode step's tokens and log-probabilities, or None when no bucket holds it."""
        b = bucket_for(len(ids), self.buckets)
        if b is None:
            return None
        self.prepare()
        step = self._steps[b]
        replayed = step.graph is not None
        try:
            sampled = step.run(pad_decode(ids, positions, starts, context_lens, b, self.pool.scratch))
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
        self._steps = {b: _Step(self.model, self.pool, self.kernels, b) for b in self.buckets}
        if not self.capture:
            return
        try:
            mempool = torch.cuda.graph_pool_handle()
            for b in sorted(self.buckets, reverse=True):
                self._steps[b].capture(mempool)
            self._check()
        except Exception as exc:  # noqa: BLE001
            self.disable(repr(exc))
            log.warning("qasr: capturing decode graphs failed (%r); decode steps run eagerly", exc)
        self.capture_s = time.perf_counter() - t0

    def _check(self) -> None:
        step = self._steps[self.buckets[0]]
        rows = step._rows
        step.load(rows)
        step.graph.replay()
        replayed = step.tokens.clone()
        step.forward(step.meta(rows))
        if not torch.equal(replayed, step.tokens):
            raise RuntimeError("a replayed decode graph gave other tokens than the eager forward")
