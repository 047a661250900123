"""The engine's core: the model, the KV pool, the scheduler and the loop thread that runs every step (one packed
encoder call and one decoder forward of decode rows and prefill chunks). Requests reach it through ``put``;
``engine.Engine`` is the client side that validates them (docs/engine.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import psutil
import torch

from qasr.audio.features import LogMel
from qasr.engine.config import EngineConfig, EngineStats
from qasr.engine.cpu.openmp import usable_cpus
from qasr.engine.device import prepare_model
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.engine.kv_blocks import BlockManager
from qasr.engine.kv_cache import KVPool, kv_bytes_per_token
from qasr.engine.request import EncodeResult, GenerationResult, KVLease, Request
from qasr.engine.runner import Runner
from qasr.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from qasr.engine.validate import Limits
from qasr.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)
RATE_WINDOW_S = 10.0


KV_SHARE = 0.6  # of a CUDA device's memory: every KV pool on it together
ALIGNER_KV_SHARE = 1 / 8  # of that budget, for an aligner's engine (its requests are prompts alone)


def default_kv_bytes(device: torch.device, aligner: bool = False) -> int:
    """The KV cache of an engine left at the default size. On CUDA every pool on the device shares one budget,
    KV_SHARE of the memory free before the first of them (free now plus what the pools hold): an aligner's
    engine takes ALIGNER_KV_SHARE of it, another engine the rest, less what the pools already hold
    (docs/engine.md, GPU specifics). On CPU two fifths of the available memory, at most 8 GiB."""
    if device.type == "cuda":
        from qasr.engine.cuda.kv_cache import held_kv_bytes

        free, _ = torch.cuda.mem_get_info(device)
        held = held_kv_bytes(device)
        budget = KV_SHARE * (free + held)
        share = budget * (ALIGNER_KV_SHARE if aligner else 1 - ALIGNER_KV_SHARE)
        return int(max(0.0, min(share, budget - held)))
    return int(min(psutil.virtual_memory().available * 0.4, 8 * 2**30))


def default_audio_bytes(device: torch.device) -> int:
    """Features and encoder rows the admitted requests may hold: a tenth of the free memory, at most 2 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.1)
    return int(min(psutil.virtual_memory().available * 0.1, 2 * 2**30))


class EngineCore:
    """Owns the model and the KV pool of one device; one thread (started by the first ``put``) runs the steps."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.checkpoint = checkpoint
        if checkpoint.model.device.type == "cuda":  # the settings a GPU runs best, where the CPU's were left
            from qasr.engine.cuda.prepare import cuda_defaults

            config = cuda_defaults(config)
        self.config = config
        self.threads = config.threads or min(torch.get_num_threads(), usable_cpus())
        torch.set_num_threads(self.threads)  # this thread's, and the default of threads torch starts later
        log.info("qasr: %s: CPU threads: %d", checkpoint.label, self.threads)
        self.prepared = prepared = prepare_model(checkpoint.model, native=config.native_kernels,
                                                 backend=config.backend, quantize=config.quantize,
                                                 label=checkpoint.label)
        model = prepared.model
        per_token = kv_bytes_per_token(checkpoint.config.decoder, model.dtype, config.kv_cache_dtype)
        budget = config.kv_cache_bytes or default_kv_bytes(model.device, checkpoint.config.is_aligner)
        blocks = -(-max(budget // per_token, 256) // config.kv_block_tokens)
        if config.kv_cache_dtype != "auto" and (prepared.make_pool is not None or model.device.type != "cpu"):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} runs on the CPU backend only: load the model "
                             "on the CPU, or leave the KV cache in the model's dtype")
        if prepared.make_pool is not None:
            self.pool = prepared.make_pool(checkpoint.config.decoder, blocks, config.kv_block_tokens, model.device,
                                           model.dtype)
        else:
            self.pool = KVPool(checkpoint.config.decoder, blocks, model.device, model.dtype,
                               block_size=config.kv_block_tokens, decode_kernel=prepared.decode_attention,
                               prefill_kernel=prepared.prefill_attention, kv_dtype=config.kv_cache_dtype)
        enc = checkpoint.config.encoder
        # an audio token's encoder row, and its share of the float32 features (a window's frames over its rows)
        window_frames = enc.window_tokens // enc.tokens_per_conv_chunk * enc.conv_chunk_frames
        token_bytes = (checkpoint.config.decoder.hidden_size * model.dtype.itemsize
                       + -(-window_frames * enc.num_mel_bins * 4 // enc.window_tokens))
        self.scheduler = Scheduler(
            SchedulerConfig(max_running=config.max_running, step_tokens=config.step_tokens,
                            prefill_chunk=config.prefill_chunk, window_tokens=enc.window_tokens,
                            audio_memory_bytes=config.audio_memory_bytes or default_audio_bytes(model.device),
                            audio_token_bytes=token_bytes), BlockManager(self.pool.allocator))
        if prepared.make_runner is not None:
            self.runner = prepared.make_runner(prepared, self.pool, checkpoint.features, config)
        else:
            self.runner = Runner(prepared, self.pool, LogMel(checkpoint.features, "cpu"), config.conv_batch)
        self.eos = frozenset(checkpoint.generation.eos_token_ids)
        # kv_prefix lengths are multiples of this, so later chunks give a fresh prefill's bits
        self.prefix_grid = 1 if prepared.chunk_invariant_prefill else config.prefill_chunk
        # drafts only where a decode row's bits do not depend on the rows beside it
        self.verifies_drafts = config.drafts and prepared.row_invariant_decode
        self.limits = Limits(checkpoint.config.audio_token_id, checkpoint.config.decoder.vocab_size,
                             checkpoint.features.hop_length, enc.num_mel_bins, enc.conv_chunk_frames, self.pool.tokens)
        self._inbox: queue.SimpleQueue[Request | KVLease | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closing = False  # no new submits; the loop ends once idle
        self._abort = False  # the loop ends now
        self._broken: BaseException | None = None
        self.steps = 0
        self._progress_at = time.perf_counter()  # the last step's end, or when idle work arrived
        self._waiting = True  # blocked on an empty inbox with nothing to do
        self.encoder_calls = 0
        self.generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens)
        # seconds by phase and token counts (docs/engine.md)
        self.timings = dict(features_s=0.0, encoder_s=0.0, forward_mixed_s=0.0, forward_decode_s=0.0, step_s=0.0,
                            prefill_tokens=0, decode_tokens=0, draft_rows=0, draft_kept=0)

    def put(self, item: Request | KVLease) -> None:
        """Hand a checked request (or a lease to free) to the loop, starting it on first use. Raises
        EngineClosed after close(), EngineBroken after a loop failure; a lease after close() is dropped."""
        with self._lock:  # one step with the check, so close() never strands a request
            if isinstance(item, KVLease) and self._closing:
                return  # the pool goes with the loop
            self.raise_if_unusable()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qasr-engine", daemon=True)
                self._thread.start()
            self._inbox.put(item)

    def raise_if_unusable(self) -> None:
        if self._broken is not None:
            raise EngineBroken(f"the engine failed and serves no more requests: {self._broken!r}") from self._broken
        if self._closing:
            raise EngineClosed("the engine is closed")

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; finish the accepted ones (``drain``) or fail them after the current step."""
        with self._lock:
            self._closing = True
            self._abort = self._abort or not drain
            thread = self._thread
        if thread is None:
            return
        self._inbox.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)

    def stats(self) -> EngineStats:
        """The engine's state, from any thread (counts may be one step stale)."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= RATE_WINDOW_S]
        rate = sum(n for _, n in recent) / RATE_WINDOW_S if recent else 0.0
        sched, alloc = self.scheduler, self.pool.allocator
        return EngineStats(waiting=len(sched.waiting) + len(sched.encoding) + self._inbox.qsize(),
                           running=len(sched.active),
                           kv_tokens_used=alloc.used, kv_tokens_total=alloc.capacity,
                           kv_blocks_used=alloc.used_blocks, kv_blocks_total=alloc.num_blocks,
                           kv_block_tokens=alloc.block_size, preemptions=sched.preemptions,
                           steps=self.steps, generated_tokens=self.generated_tokens, tokens_per_s=rate,
                           broken=self._broken is not None, closed=self._closing, kv_cache_bytes=self.pool.nbytes,
                           stalled_s=self.stalled_s(now))

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds since the last step ended (or idle work arrived) while the engine has work; 0 when idle."""
        if self._waiting or self._broken is not None or self._thread is None:
            return 0.0
        return max(0.0, (time.perf_counter() if now is None else now) - self._progress_at)


    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP's count is per thread; the native kernels read it too
        try:
            while not self._abort:
                if self.scheduler.idle:
                    if self._closing and self._inbox.empty():
                        break
                    # an idle engine's OpenMP pool throttles a busy one's (docs/log, engine-openmp-two-engines)
                    self.prepared.release_caller_threads()
                    self._waiting = True
                    item = self._inbox.get()
                    self._progress_at, self._waiting = time.perf_counter(), False
                    self._take(item)
                while True:
                    try:
                        self._take(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if not self.scheduler.idle and not self._abort:
                    self.step()
        except BaseException as exc:  # noqa: BLE001
            log.exception("qasr engine loop failed; the engine is now broken")
            self._broken = exc
        finally:
            self._fail_everything()
            self._waiting = True

    def _take(self, item: Request | KVLease | None) -> None:
        if isinstance(item, KVLease):
            self.scheduler.blocks.release(item)
        elif item is not None:
            self.scheduler.add(item)

    def _fail_everything(self) -> None:
        with self._lock:
            self._closing = True
        if self._broken is not None:
            error: BaseException = EngineBroken(f"the engine failed: {self._broken!r}")
            error.__cause__ = self._broken
        else:
            error = EngineClosed("the engine was closed before this request finished")
        pending = [*self.scheduler.encoding, *self.scheduler.active, *self.scheduler.waiting]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                pending.append(item)
        self.scheduler.encoding.clear()
        self.scheduler.active.clear()
        self.scheduler.waiting.clear()
        for req in pending:
            req.resolve(error=error)

    def step(self) -> None:
        """One scheduling step; a failing one is rerun a request at a time so only the culprit fails."""
        sched = self.scheduler
        t_step = time.perf_counter()
        for req in [r for r in sched.active if r.cancelled]:
            sched.finish(req)
            req.resolve()
        for req in sched.drop_cancelled():
            req.resolve()
        for req in sched.admit():  # submit refuses these already: nothing waits forever on memory
            req.resolve(error=ValueError(f"request needs {req.needs_tokens} KV-cache tokens but the cache holds "
                                         f"{self.pool.tokens}"))
        plan = sched.plan()
        encoded = False
        try:
            if plan.encode:
                self._encode(plan.encode)
            encoded = True
            sampled = self._forward(plan)
        except Exception as exc:  # noqa: BLE001
            sampled = self._rerun_alone(plan, exc, encoded)
        self.steps += 1
        self._finish_encodes(plan)
        self._apply(sampled)
        self._finish_alignments(plan)
        now = time.perf_counter()
        self.timings["step_s"] += now - t_step
        self._progress_at = now

    def _finish_encodes(self, plan: StepPlan) -> None:
        for req, _ in plan.encode:
            if req.encode_only and req.encoded and req in self.scheduler.encoding:
                self.scheduler.finish(req)
                assert req.audio is not None and req.conv is not None
                req.resolve(EncodeResult(req.audio, req.conv))

    def _encode(self, slices: list[tuple[Request, int]]) -> None:
        t0 = time.perf_counter()
        self.encoder_calls += 1
        self.timings["features_s"] += self.runner.encode(slices)
        self.timings["encoder_s"] += time.perf_counter() - t0

    def _forward(self, plan: StepPlan) -> list[tuple[Request, int]]:
        if not (plan.decode or plan.prefill):
            return []
        t0 = time.perf_counter()
        sampled = self.runner.forward(plan)
        st = self.timings
        st["forward_mixed_s" if plan.prefill else "forward_decode_s"] += time.perf_counter() - t0
        st["prefill_tokens"] += sum(n for _, n in plan.prefill)
        st["decode_tokens"] += len(plan.decode)
        guessed = sum(len(g) for g in plan.drafts.values())
        if guessed:  # each kept token beyond a row's first is a guess that came true
            st["draft_rows"] += guessed
            st["draft_kept"] += len(sampled) - len({id(r) for r, _ in sampled})
        return sampled

    def _rerun_alone(self, plan: StepPlan, exc: Exception, encoded: bool) -> list[tuple[Request, int]]:
        """Rerun each request's share of a failed step alone; the culprit fails with its own error."""
        reqs = plan.requests
        log.warning("qasr: a step of %d requests failed (%r); rerunning them one by one", len(reqs), exc)
        sampled = []
        failed: list[Exception] = []
        for req in reqs:
            own = plan.only(req)
            try:
                if own.encode and not encoded:
                    self._encode(own.encode)
                sampled += self._forward(own)
            except Exception as err:  # noqa: BLE001
                log.error("qasr: request %d failed: %r", req.id, err)
                self.scheduler.finish(req)
                req.resolve(error=err)
                failed.append(err)
        # no culprit: the device is failing (a sticky error); break the engine. A ValueError names the
        # request's own data (e.g. non-finite audio), so it is never proof of a failing device.
        if len(reqs) > 1 and len(failed) == len(reqs) and not any(isinstance(e, ValueError) for e in failed):
            raise RuntimeError(f"every one of the {len(reqs)} requests of a step failed alone as well (the first "
                               f"with {failed[0]!r}): the device, not a request, is failing") from exc
        return sampled

    def _apply(self, sampled: list[tuple[Request, int]]) -> None:
        now = time.perf_counter()
        generated = 0
        ended: set[int] = set()
        for req, token in sampled:
            if id(req) in ended:
                continue
            if req.first_token_at is None:
                req.first_token_at = now
            reason = None
            if not req.spec.ignore_eos and token in self.eos:
                reason = "stop"
            else:
                req.output.append(token)  # a preempted request keeps its tokens: each is made and delivered once
                generated += 1
                if req.on_token is not None and not self._deliver(req, token):
                    ended.add(id(req))
                    continue
                if len(req.output) >= req.max_new_tokens:
                    reason = "length"
            if reason is not None:
                ended.add(id(req))
                lease = None
                if req.spec.continuation.keep_kv:
                    self.scheduler.retire(req)
                    lease = self.scheduler.blocks.keep(req)
                else:
                    self.scheduler.finish(req)
                req.resolve(GenerationResult(req.output, reason, req.first_token_at - req.submitted,
                                             now - req.submitted, kv=lease, preempted=tuple(req.preempted),
                                             logprobs=tuple(req.logprobs[:len(req.output)])))
                if lease is not None and req.future.cancelled():
                    lease.taken = True
                    self.scheduler.blocks.release(lease)
        self.generated_tokens += generated
        self._recent.append((now, generated))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _finish_alignments(self, plan: StepPlan) -> None:
        for req, _ in plan.prefill:
            if req.classify is not None and req.prefill_done and req in self.scheduler.active:
                self.scheduler.finish(req)
                req.resolve(req.classes)

    def _deliver(self, req: Request, token: int) -> bool:
        """A listener that raises ends its own request only."""
        try:
            req.on_token(token)  # type: ignore[misc]
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("qasr: token listener of request %d failed (%r); cancelling it", req.id, exc)
            req.on_token = None
            self.scheduler.finish(req)
            req.resolve(error=exc)
            return False
