"""One turn of the official streaming algorithm, token for token; a step costs what the open window does.
One thread at a time; its work is requests of the shared engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from qasr.engine.engine import Continuation, Engine, RequestSpec
from qasr.engine.request import KVLease
from qasr.model.checkpoint import Checkpoint
from qasr.streaming.config import StreamConfig
from qasr.streaming.logmel import StreamingLogMel
from qasr.streaming.pcm import SampleBuffer, as_float_pcm
from qasr.streaming.steps import StepResult, StreamText
from qasr.streaming.text import PromptBuilder
from qasr.streaming.windows import KeptWindow, WindowEncoder, answer

UPDATE_QUEUE = 1024


@dataclass(frozen=True)
class Update:
    """The transcript after a step: ``stable_text`` never changes once reported; ``unstable_text`` may."""

    stable_text: str
    unstable_text: str
    language: str
    final: bool
    step: int

    @property
    def text(self) -> str:
        return self.stable_text + self.unstable_text


@dataclass
class SessionStats:
    """What each step computed rather than kept."""

    frames: list[int] = field(default_factory=list)
    encoder_tokens: list[int] = field(default_factory=list)
    windows_recomputed: list[int] = field(default_factory=list)
    conv_chunks: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    stable_conflicts: int = 0


class Session:
    def __init__(self, engine: Engine, checkpoint: Checkpoint, config: StreamConfig | None = None,
                 record: bool = False, buffer: SampleBuffer | None = None) -> None:
        """``record``: keep every step's StepResult, not only the last. ``buffer``: reused across turns."""
        self.engine = engine
        self.checkpoint = checkpoint
        self.config = config = config or StreamConfig()
        self.state = StreamText(config, PromptBuilder(checkpoint.tokenizer, checkpoint.special, config.context,
                                                      config.language), record=record)
        self.audio = buffer if buffer is not None else SampleBuffer()
        self.audio.reset()
        self.consumed = 0
        self.mel = StreamingLogMel(checkpoint.features)
        self.encoder = WindowEncoder(engine, config.engine_timeout_s)
        self.stats = SessionStats()
        self.stable = ""
        self.finished = False
        self._lease: KVLease | None = None
        self._lease_windows: tuple[KeptWindow, ...] = ()
        self._window_tokens = checkpoint.config.encoder.window_tokens
        # bounded: a caller of push() may never drain it
        self._undelivered: deque[Update] = deque(maxlen=UPDATE_QUEUE)

    @property
    def samples(self) -> int:
        """Samples pushed so far."""
        return self.audio.size

    @property
    def results(self) -> list[StepResult]:
        """The StepResults (all with ``record``, else the last)."""
        return self.state.results

    def push(self, pcm: np.ndarray) -> list[Update]:
        """Add 16 kHz float32 or int16 samples; the updates of the steps (one per chunk) they completed."""
        if self.finished:
            raise RuntimeError("the session is finished")
        self.audio.append(as_float_pcm(pcm))
        n = self.config.chunk_size_samples
        out = []
        while self.audio.size - self.consumed >= n:
            self.consumed += n
            out.append(self._step(self.state.prefix(), final=False))
        return out

    def finish(self) -> Update:
        """Decode the rest; the final update has all its text stable."""
        if self.finished:
            raise RuntimeError("the session is finished")
        self.finished = True
        tail = self.audio.size > self.consumed
        self.consumed = self.audio.size
        if tail and self.audio.size >= self.checkpoint.features.hop_length:
            return self._step(self.state.prefix(at_finish=True), final=True)
        self.close()
        return self._publish(self.state.text, final=True, step=self.state.steps - 1)

    def updates(self) -> Iterator[Update]:
        """The updates not yet taken (at most the last UPDATE_QUEUE)."""
        while self._undelivered:
            yield self._undelivered.popleft()

    def __iter__(self) -> Iterator[Update]:
        return self.updates()

    def _step(self, prefix: str, final: bool) -> Update:
        samples = self.audio.view(self.consumed)
        self.stats.frames.append(self.mel.advance(samples))
        encoded = self.encoder.encode(self.mel)
        embeds = encoded.rows
        self.stats.encoder_tokens.append(encoded.computed)
        self.stats.windows_recomputed.append(encoded.recomputed)
        self.stats.conv_chunks.append(encoded.conv_chunks)
        prompt = self.state.prompts(embeds.shape[0], prefix)
        reuse = self._reusable(prompt)
        lease, self._lease = self._lease, None
        if lease is not None and not reuse:
            self.engine.release(lease)
        self.stats.prefill_tokens.append(len(prompt) - reuse)
        try:
            carry = Continuation(keep_kv=not final, kv_prefix=(lease, reuse) if reuse else None,
                                 draft=self.state.guess(prefix))
            future = self.engine.submit(RequestSpec(prompt, self.config.max_new_tokens, audio_embeds=embeds,
                                                    interactive=True, continuation=carry))
        except Exception:
            if lease is not None:
                self.engine.release(lease)
            raise
        result = answer(future, self.config.engine_timeout_s)
        self._lease, self._lease_windows = result.kv, self.encoder.used
        step = self.state.absorb(self.consumed, prefix, prompt, result.token_ids, final)
        return self._publish(step.text, final, step.index)

    def _reusable(self, prompt: list[int]) -> int:
        """Prompt positions whose KV the last step holds, rounded down to the engine's ``prefix_grid``."""
        if self._lease is None:
            return 0
        shared = 0
        for old, new in zip(self._lease_windows, self.encoder.used, strict=False):
            if old is not new:
                break
            shared += 1
        head = prompt.index(self.checkpoint.special.audio_pad)
        grid = self.engine.prefix_grid
        return (head + shared * self._window_tokens) // grid * grid

    def close(self) -> None:
        """Free the KV kept for the next step (``finish`` does too)."""
        if self._lease is not None:
            self.engine.release(self._lease)
            self._lease = None

    def _publish(self, text: str, final: bool, step: int) -> Update:
        if final:
            committed = text
        else:
            committed = self.state.prompts.parse(self.state.prefix())[1]
        if not text.startswith(self.stable):
            self.stats.stable_conflicts += 1
        elif committed.startswith(self.stable) and text.startswith(committed):
            self.stable = committed
        if text.startswith(self.stable):
            update = Update(self.stable, text[len(self.stable):], self.state.language, final, step)
        else:  # committed text was revised: keep it, show nothing beyond
            update = Update(self.stable, "", self.state.language, final, step)
        self._undelivered.append(update)
        return update
