"""One encoder call for the open windows of every live session that needs one at the same moment.

Sessions encode on their own threads. Each hands its features to the engine's ``EncoderBatcher``: the first
thread to arrive runs the encoder on everything queued, in one packed call, and keeps doing so while more
arrives; the others wait for their rows. Nothing waits on purpose: requests that arrive while a call runs
form the next call. The encoder gives a window the same bits alone or packed with others (see
docs/streaming.md, "Exactness"), so batching changes no result, only the number of calls.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qasr.engine.engine import Engine

RunMany = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class _Job:
    features: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    rows: torch.Tensor | None = None
    error: BaseException | None = None


class EncoderBatcher:
    def __init__(self, run_many: RunMany) -> None:
        self._run_many = run_many
        self._lock = threading.Lock()
        self._queue: list[_Job] = []
        self._running = False
        self.calls = 0  # encoder calls made
        self.jobs = 0  # feature blocks encoded

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        job = _Job(features)
        with self._lock:
            self._queue.append(job)
            lead = not self._running
            self._running = True
        if lead:
            self._serve()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.rows is not None
        return job.rows

    def _serve(self) -> None:
        """Run packed calls until nothing is queued (then the next arrival leads)."""
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._running = False
                    return
            try:
                outputs = self._run_many([j.features for j in batch])
                for j, rows in zip(batch, outputs, strict=True):
                    j.rows = rows
            except BaseException as exc:  # noqa: BLE001 - every waiting session gets the failure
                for j in batch:
                    j.error = exc
            finally:
                self.calls += 1
                self.jobs += len(batch)
                for j in batch:
                    j.done.set()


_batchers: weakref.WeakKeyDictionary[Engine, EncoderBatcher] = weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(engine: Engine) -> EncoderBatcher:
    """The engine's batcher (one per engine, made on first use)."""
    with _batchers_lock:
        batcher = _batchers.get(engine)
        if batcher is None:
            model = engine.prepared.model
            tower, kernels, conv_batch = model.audio_tower, engine.runner.kernels, engine.runner.conv_batch
            param = next(tower.parameters())

            @torch.inference_mode()
            def run_many(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
                return tower([b.to(param.device, param.dtype) for b in blocks], conv_batch=conv_batch,
                             kernels=kernels)

            batcher = _batchers[engine] = EncoderBatcher(run_many)
        return batcher
