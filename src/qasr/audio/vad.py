"""Voice activity detection, online: 16 kHz audio in any sizes -> speech regions, by silero-vad's rules
(scored in blocks of ``BLOCK_FRAMES`` from the start, so the regions never depend on the feeding)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from qasr.audio.io import SAMPLE_RATE
from qasr.audio.vad_models import (
    FRAME,
    EnergyScorer,
    FrameScorer,
    SileroJit,
    SileroOnnx,
    onnxruntime_available,
    silero_available,
)

log = logging.getLogger(__name__)

BLOCK_FRAMES = 64  # frames per model call: amortises the call, bounds the lag
VadBackend = Literal["auto", "silero", "energy"]
_BACKENDS = ("auto", "silero", "energy")
_warned_fallback = False


@dataclass(frozen=True)
class VadConfig:
    """Speech detection settings, silero-vad's defaults. ``backend``: "silero" (needs ``silero-vad``),
    "energy", or "auto" (silero when installed, else energy with one warning). ``neg_threshold`` defaults
    to ``max(threshold - 0.15, 0.01)``."""

    threshold: float = 0.5
    min_speech_s: float = 0.25
    min_silence_s: float = 0.1
    speech_pad_s: float = 0.03
    backend: VadBackend = "auto"
    neg_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"VadConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"VadConfig.threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            raise ValueError("VadConfig.neg_threshold must be in [0, threshold]")
        if min(self.min_speech_s, self.min_silence_s, self.speech_pad_s) < 0:
            raise ValueError("VadConfig durations must be non-negative")

    @property
    def exit_threshold(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(self.threshold - 0.15, 0.01)


def resolve_backend(backend: VadBackend, warn: bool = True) -> str:
    """The scorer a backend name runs on: "silero-onnx", "silero-jit" or "energy". ``warn``: say so (once per
    process) when "auto" falls back to energy."""
    if backend == "energy":
        return "energy"
    if silero_available():
        return "silero-onnx" if onnxruntime_available() else "silero-jit"
    if backend == "silero":
        raise RuntimeError("VAD backend 'silero' needs the silero-vad package: pip install 'qasr[vad]'")
    if warn:
        _warn_fallback()
    return "energy"


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:  # once per process, not per file
        _warned_fallback = True
        log.warning("silero-vad is not installed: speech detection uses the energy-based fallback VAD")


def make_scorer(name: str) -> FrameScorer:
    if name == "silero-onnx":
        return SileroOnnx()
    if name == "silero-jit":
        return SileroJit()
    return EnergyScorer()


class SpeechDetector:
    """``feed(samples)`` returns the regions it made final, ``flush()`` the rest: half-open ``(start, end)``
    sample offsets, in order, never overlapping, each reported once its padded end cannot change."""

    def __init__(self, config: VadConfig | None = None) -> None:
        self.config = config or VadConfig()
        self.backend = resolve_backend(self.config.backend, warn=False)
        self._scorer: FrameScorer | None = None  # made by the first audio scored: many detectors never score
        cfg = self.config
        self._min_speech = cfg.min_speech_s * SAMPLE_RATE
        self._min_silence = cfg.min_silence_s * SAMPLE_RATE
        self._pad = int(cfg.speech_pad_s * SAMPLE_RATE)
        self._pending = np.zeros(0, dtype=np.float32)  # fed, not yet scored (< one block)
        self._fed = 0
        self._frames = 0
        self._triggered = False
        self._start = 0  # raw start of the region under way
        self._temp_end: int | None = None  # first frame of the silence that may end that region
        self._held: tuple[int, int] | None = None  # kept region: (padded start, raw end), end unsettled
        self._last_end = 0
        self._flushed = False

    @property
    def samples_fed(self) -> int:
        return self._fed

    @property
    def frontier(self) -> int:
        """No region reported from now on starts before this sample offset."""
        if self._held is not None:
            return self._held[0]
        pos = self._start if self._triggered else self._frames * FRAME
        return max(pos - self._pad, self._last_end, 0)

    @property
    def open_region(self) -> tuple[int, int] | None:
        """``(start, end_at_least)`` of the next region once it is sure to be reported (its start final);
        else None."""
        if self._held is not None:
            return self._held
        if not self._triggered:
            return None
        end = self._temp_end if self._temp_end is not None else self._frames * FRAME
        if end - self._start <= self._min_speech:
            return None
        return max(self._start - self._pad, self._last_end, 0), end

    def feed(self, chunk: np.ndarray) -> list[tuple[int, int]]:
        if self._flushed:
            raise RuntimeError("SpeechDetector.feed after flush()")
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        self._fed += chunk.size
        self._pending = np.concatenate((self._pending, chunk)) if self._pending.size else chunk
        block = BLOCK_FRAMES * FRAME
        whole = self._pending.size // block * block
        out: list[tuple[int, int]] = []
        if whole:
            self._score(self._pending[:whole].reshape(-1, FRAME), out)
            self._pending = self._pending[whole:].copy()
        return out

    def flush(self) -> list[tuple[int, int]]:
        """End of input: every region left."""
        if self._flushed:
            return []
        self._flushed = True
        out: list[tuple[int, int]] = []
        if self._pending.size:
            frames = np.zeros(-(-self._pending.size // FRAME) * FRAME, dtype=np.float32)
            frames[: self._pending.size] = self._pending
            self._score(frames.reshape(-1, FRAME), out)
            self._pending = np.zeros(0, dtype=np.float32)
        total = self._fed
        if self._triggered and total - self._start > self._min_speech:
            self._keep(self._start, total, out)
        self._triggered = False
        if self._held is not None:
            start, end = self._held
            self._emit(start, min(total, end + self._pad), out)
            self._held = None
        return out

    def _score(self, frames: np.ndarray, out: list[tuple[int, int]]) -> None:
        if self._scorer is None:
            if self.backend == "energy" and self.config.backend == "auto":
                _warn_fallback()
            self._scorer = make_scorer(self.backend)
        for p in self._scorer.score(frames):
            self._step(float(p), out)

    def _step(self, p: float, out: list[tuple[int, int]]) -> None:
        cur = self._frames * FRAME
        self._frames += 1
        cfg = self.config
        if not self._triggered:
            if p >= cfg.threshold:
                self._triggered, self._start, self._temp_end = True, cur, None
        elif p >= cfg.threshold:
            self._temp_end = None  # a pause inside the region
        elif p < cfg.exit_threshold:
            if self._temp_end is None:
                self._temp_end = cur
            if cur - self._temp_end >= self._min_silence:
                self._triggered = False
                if self._temp_end - self._start > self._min_speech:
                    self._keep(self._start, self._temp_end, out)
                self._temp_end = None
        self._settle_held(out)

    def _keep(self, start: int, end: int, out: list[tuple[int, int]]) -> None:
        padded_start = max(0, start - self._pad)
        if self._held is not None:
            held_start, held_end = self._held
            gap = start - held_end
            if gap < 2 * self._pad:  # too close to pad both: share the gap
                self._emit(held_start, held_end + gap // 2, out)
                padded_start = start - gap // 2
            else:
                self._emit(held_start, held_end + self._pad, out)
        self._held = (max(padded_start, self._last_end), end)

    def _settle_held(self, out: list[tuple[int, int]]) -> None:
        if self._held is None:
            return
        next_start = self._start if self._triggered else self._frames * FRAME
        if next_start - self._held[1] >= 2 * self._pad:
            start, end = self._held
            self._emit(start, end + self._pad, out)
            self._held = None

    def _emit(self, start: int, end: int, out: list[tuple[int, int]]) -> None:
        out.append((start, end))
        self._last_end = end


def speech_regions(wave: np.ndarray, config: VadConfig | None = None) -> list[tuple[int, int]]:
    """Speech regions ``(start, end)`` in samples of a whole 16 kHz waveform."""
    detector = SpeechDetector(config)
    return detector.feed(wave) + detector.flush()
