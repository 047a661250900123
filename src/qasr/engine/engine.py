"""The engine's client side: ``Engine`` checks each request, computes its log-mel on the submitting thread
and hands it to the core (core.py), which batches every request on one thread. No request harms another
(docs/engine.md).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import torch

from qasr.audio.features import LogMel
from qasr.engine.backend import PreparedModel
from qasr.engine.config import EngineConfig, EngineStats
from qasr.engine.core import EngineCore
from qasr.engine.request import Continuation, GenerationResult, KVLease, Request, RequestSpec
from qasr.engine.validate import (
    Limits,
    check_conv_head,
    check_encoder_features,
    check_positions,
    check_request,
    check_spec,
)
from qasr.model.checkpoint import Checkpoint

__all__ = ["Continuation", "Engine", "EngineConfig", "EngineStats", "GenerationResult", "KVLease", "RequestSpec"]


class Engine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig()) -> None:
        self.checkpoint = checkpoint
        self.core = EngineCore(checkpoint, config)
        self.config = self.core.config  # what it runs: on CUDA, the GPU defaults where the CPU's were left
        # the CPU runner's log-mel, run by submitting threads (front ends make pieces' features with it); other
        # devices make it on the device, inside the step
        self.log_mel = LogMel(checkpoint.features, "cpu") if self.device.type == "cpu" else None
        self.audio_token_id = checkpoint.config.audio_token_id
        self._lock = threading.Lock()  # lease hand-over

    @property
    def prepared(self) -> PreparedModel:
        return self.core.prepared

    @property
    def description(self) -> str:
        """How the model runs: backend, dtype and kernels."""
        return self.core.prepared.description

    def release_caller_threads(self) -> None:
        """Free the calling thread's idle OpenMP pool, which slows the engine's (cpu/openmp.py)."""
        self.core.prepared.release_caller_threads()

    @property
    def device(self) -> torch.device:
        return self.core.prepared.model.device

    @property
    def limits(self) -> Limits:
        return self.core.limits

    @property
    def threads(self) -> int:
        return self.core.threads

    @property
    def prefix_grid(self) -> int:
        """kv_prefix lengths are multiples of this, so later chunks give a fresh prefill's bits."""
        return self.core.prefix_grid

    @property
    def verifies_drafts(self) -> bool:
        return self.core.verifies_drafts

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def timings(self) -> dict[str, float]:
        """Seconds by phase and token counts (docs/engine.md)."""
        return self.core.timings

    def submit(self, spec: RequestSpec, on_token: Callable[[int | None], None] | None = None) -> Future:
        """Queue one request (thread-safe); the future resolves to a GenerationResult. ``on_token``, called
        on the engine thread, gets each token, then None. Cancelling the future stops the request. Raises
        ValueError for a malformed spec, EngineClosed after close(), EngineBroken after a loop failure."""
        submitted = time.perf_counter()  # the result's ttft_s and latency_s include the log-mel made here
        if self.checkpoint.config.is_aligner:
            raise ValueError("this engine runs a forced-aligner checkpoint (its head classifies timestamps, it "
                             "generates no text): use submit_alignment")
        spec = check_spec(spec, self.limits, self.checkpoint.config.decoder.hidden_size, self.device,
                          self.prefix_grid)
        if spec.waveform is not None and self.log_mel is not None:
            spec = replace(spec, waveform=None, features=self.log_mel(spec.waveform))
        cont = spec.continuation
        if cont.draft and not self.verifies_drafts:
            cont = replace(cont, draft=())
        prompt = spec.prompt
        req = Request(replace(spec, waveform=None, features=None, audio_embeds=None, continuation=cont),
                      on_token=on_token, waveform=spec.waveform, features=spec.features,
                      audio_tokens=prompt.count(self.audio_token_id), audio_before=self._audio_before(prompt),
                      submitted=submitted)
        if spec.audio_embeds is not None:
            req.audio, req.encoded_tokens = spec.audio_embeds, req.audio_tokens
        if cont.kv_prefix is not None:
            lease, n = cont.kv_prefix
            with self._lock:
                if lease.taken:
                    raise ValueError("kv_prefix: this KV lease was already used or released")
                lease.taken = True
            req.kv_prefix, req.prefix_len = lease, n  # taken over (or found evicted: prefilled) at admission
        return self._enqueue(req)

    def release(self, lease: KVLease) -> None:
        """Free a lease no request will take over (no-op if used or released)."""
        with self._lock:
            if lease.taken:
                return
            lease.taken = True
        self.core.put(lease)

    def submit_alignment(self, prompt: list[int], *, positions: Sequence[int], waveform: np.ndarray | None = None,
                         features: torch.Tensor | None = None) -> Future:
        """Queue a forced-alignment request (aligner checkpoints): the future resolves to the head's argmax at
        each of ``positions``, ascending. Raises like ``submit``."""
        if not self.checkpoint.config.is_aligner:
            raise ValueError("alignment requests need a forced-aligner checkpoint (a timestamp classifier head)")
        waveform, features, audio_tokens = check_request(prompt, waveform, features, 0, self.limits,
                                                         min_new_tokens=0)
        if waveform is not None and self.log_mel is not None:
            waveform, features = None, self.log_mel(waveform)
        prompt = [int(t) for t in prompt]
        req = Request(RequestSpec(prompt, 0), waveform=waveform, features=features, audio_tokens=audio_tokens,
                      classify=check_positions(positions, len(prompt)), audio_before=self._audio_before(prompt))
        return self._enqueue(req)

    def submit_encode(self, features: torch.Tensor, conv_head: torch.Tensor | None = None) -> Future:
        """Queue an encoder-only request for (mel, frames) features; the future resolves to an EncodeResult.
        ``conv_head``: an earlier EncodeResult.conv of the chunks before them (all in one window)."""
        features, rows = check_encoder_features(features, self.limits)
        if conv_head is not None:
            rows = check_conv_head(conv_head, features.shape[-1], self.checkpoint.config.encoder,
                                   self.device)
        req = Request(RequestSpec([], 0), features=features, audio_tokens=rows, encode_only=True,
                      conv_head=conv_head, audio_before=np.zeros(1, dtype=np.int64))
        return self._enqueue(req)

    def _audio_before(self, prompt: list[int]) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(np.asarray(prompt) == self.audio_token_id)])

    def _enqueue(self, req: Request) -> Future:
        self.core.put(req)
        self.release_caller_threads()
        return req.future

    async def generate_async(self, spec: RequestSpec) -> GenerationResult:
        """``submit`` for asyncio; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(spec))

    def tokens(self, spec: RequestSpec) -> Iterator[int]:
        """Each token id as it is sampled, then the request's error if any; closing it cancels the request."""
        tokens: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        return _drain(tokens, self.submit(spec, on_token=tokens.put))

    async def tokens_async(self, spec: RequestSpec) -> AsyncIterator[int]:
        """``tokens`` for asyncio: an async iterator of token ids."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        future = self.submit(spec, on_token=lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t))
        try:
            while (token := await tokens.get()) is not None:
                yield token
            await asyncio.wrap_future(future)  # its error, if any
        finally:
            future.cancel()  # no-op once done

    def stats(self) -> EngineStats:
        """The engine's state, from any thread (counts may be one step stale)."""
        return self.core.stats()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests, finishing what was accepted (``drain``) or failing it with EngineClosed
        after the current step; every future is resolved. ``timeout`` bounds the wait."""
        self.core.close(drain, timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        # leaving on an error (Ctrl-C included) must not wait for the queue
        self.close(drain=exc_type is None)


def _drain(tokens: queue.SimpleQueue, future: Future) -> Iterator[int]:
    try:
        while (token := tokens.get()) is not None:
            yield token
        future.result()  # its error, if any
    finally:
        future.cancel()  # the consumer stopped early (no-op once done)
