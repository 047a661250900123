"""The engine: owns the model and the KV pool, batches every submitted request on one loop.

``submit`` is thread-safe and returns a ``concurrent.futures.Future``; ``generate_async`` wraps it for
asyncio. One background thread drives the device: each step admits waiting requests into KV regions,
encodes newly admitted audio in one packed call, and runs one packed decoder forward that mixes the
decode rows of running requests with chunked prefill of new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from qasr.engine.cpu.conv import gemm_convs
from qasr.engine.cpu.linear import channels_last_convs, fuse_norms, pack_linears, packing_supported
from qasr.engine.kv_cache import KVPool, kv_bytes_per_token
from qasr.engine.cpu.native import linear_kernel
from qasr.engine.cpu.openmp import release_idle_workers
from qasr.engine.request import GenerationResult, Request
from qasr.engine.runner import Runner
from qasr.engine.scheduler import Scheduler, SchedulerConfig
from qasr.features import LogMel
from qasr.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int | None = None  # None: 40% of available memory on CPU, capped at 8 GiB
    max_running: int = 64
    prefill_tokens: int = 512  # prompt tokens per step (whole chunks), riding along with the decode rows
    prefill_chunk: int = 256  # the fixed chunk grid of every prompt (keeps outputs batch-independent)
    encoder_tokens: int = 512  # encoder output tokens per step (whole requests, at least one)
    conv_batch: int = 8  # 1 s chunks per conv call: small groups keep the activations in cache
    use_native: bool = True  # the C++ decode-attention kernel on CPU (falls back when it cannot build)
    pack_weights: bool = True  # oneDNN-prepacked linears for bf16 on CPU


def default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.6)
    return int(min(psutil.virtual_memory().available * 0.4, 8 * 2**30))


class Engine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig()) -> None:
        self.checkpoint = checkpoint
        self.config = config
        model = checkpoint.model
        if config.pack_weights and packing_supported(model.device, model.dtype) and not getattr(
                model, "_qasr_packed", False):
            pack_linears(model)
            if (kernel := linear_kernel()) is not None:
                gemm_convs(model, kernel)
            channels_last_convs(model)  # only the convs gemm_convs left (no weight copies thrown away)
            fuse_norms(model)
            model._qasr_packed = True  # the checkpoint's model is shared by every engine made from it
        per_token = kv_bytes_per_token(checkpoint.config.decoder, model.dtype)
        budget = config.kv_cache_bytes or default_kv_bytes(model.device)
        tokens = max(budget // per_token, 256)
        self.pool = KVPool(checkpoint.config.decoder, tokens, model.device, model.dtype, config.use_native)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_running, config.prefill_tokens, config.prefill_chunk, config.encoder_tokens),
            self.pool.allocator)
        self.runner = Runner(model, self.pool, LogMel(checkpoint.features, "cpu"), config.conv_batch)
        self.eos = frozenset(checkpoint.generation.eos_token_ids)
        self.audio_token_id = checkpoint.config.audio_token_id
        self._inbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.steps = 0
        # wall seconds by phase; step_s is the total, what it has beyond the others is host-side work.
        # forward_mixed_s counts forwards that carry prefill chunks (decode rows may ride along).
        self.timings = dict(features_s=0.0, encoder_s=0.0, forward_mixed_s=0.0, forward_decode_s=0.0, step_s=0.0,
                          prefill_tokens=0, decode_tokens=0)

    # ------------------------------------------------------------------ public API
    def submit(self, prompt: list[int], *, waveform: np.ndarray | None = None, features: torch.Tensor | None = None,
               max_new_tokens: int, ignore_eos: bool = False) -> Future:
        """Queue one request; the future resolves to a GenerationResult (or raises its error)."""
        if (waveform is None) == (features is None):
            raise ValueError("pass exactly one of waveform or features")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        req = Request(prompt=list(prompt), max_new_tokens=int(max_new_tokens), ignore_eos=ignore_eos,
                      waveform=waveform, features=features,
                      audio_tokens=sum(1 for t in prompt if t == self.audio_token_id))
        self._ensure_thread()
        release_idle_workers()  # this thread's idle OpenMP pool would slow the engine's (see openmp.py)
        self._inbox.put(req)
        return req.future

    async def generate_async(self, prompt: list[int], **kwargs: object) -> GenerationResult:
        return await asyncio.wrap_future(self.submit(prompt, **kwargs))  # type: ignore[arg-type]

    def close(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                if self._stopped:
                    raise RuntimeError("engine is closed")
                self._thread = threading.Thread(target=self._loop, name="qasr-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while not self._stopped:
            if self.scheduler.idle:
                self._take(self._inbox.get())  # nothing to do: sleep until a request (or close) arrives
            while True:
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not self.scheduler.idle:
                self.step()

    def _take(self, item: Request | None) -> None:
        if item is not None:  # None only wakes the loop (close)
            self.scheduler.add(item)

    def step(self) -> None:
        """One scheduling step. A failure fails the requests involved, never the loop."""
        sched = self.scheduler
        t_step = time.perf_counter()
        for req in sched.admit():
            req.future.set_exception(ValueError(
                f"request needs {req.needs_tokens} KV-cache tokens but the cache holds {self.pool.tokens}; "
                f"raise kv_cache_bytes or lower max_new_tokens / max_chunk_sec"))
        plan = sched.plan()
        st = self.timings
        try:
            if plan.encode:
                t0 = time.perf_counter()
                st["features_s"] += self.runner.encode(plan.encode)
                st["encoder_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            sampled = self.runner.forward(plan) if (plan.decode or plan.prefill) else []
            st["forward_mixed_s" if plan.prefill else "forward_decode_s"] += time.perf_counter() - t0
            st["prefill_tokens"] += sum(n for _, n in plan.prefill)
            st["decode_tokens"] += len(plan.decode)
        except Exception as exc:  # fail what this step touched, keep serving the rest
            log.exception("qasr engine step failed")
            touched = {id(r): r for r in [*plan.encode, *plan.decode, *(r for r, _ in plan.prefill)]}
            for req in touched.values():
                sched.finish(req)
                if not req.future.done():
                    req.future.set_exception(exc)
            return
        self.steps += 1
        now = time.perf_counter()
        for req, token in sampled:
            if req.first_token_at is None:
                req.first_token_at = now
            reason = None
            if not req.ignore_eos and token in self.eos:
                reason = "eos"
            else:
                req.output.append(token)
                if len(req.output) >= req.max_new_tokens:
                    reason = "length"
            if reason is not None:
                sched.finish(req)
                if not req.future.cancelled():
                    req.future.set_result(GenerationResult(req.output, reason, req.first_token_at - req.submitted,
                                                           now - req.submitted))
        st["step_s"] += time.perf_counter() - t_step
