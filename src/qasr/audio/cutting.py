"""Cutting an input into segments as it is decoded; a segment's samples equal that span of ``load_audio``."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import soxr

from qasr.audio.decode_blocks import BlockDecoder
from qasr.audio.io import (
    EMPTY_FILE,
    SAMPLE_RATE,
    AudioError,
    AudioSource,
    EncodedAudio,
    checked_encoded,
    checked_path,
    load_audio,
)
from qasr.audio.segments import AudioSegment, Segmenter, SegmentMode
from qasr.audio.vad import VadConfig

DEFAULT_BLOCK_S = 10.0


class SegmentCutter(Iterator[AudioSegment]):
    """An input's segments in order, decoded as consumed. ``duration``: the container's seconds (or None)
    until exhausted, then exact."""

    def __init__(self, segments: Iterator[AudioSegment], duration: float | None, segmenter: Segmenter) -> None:
        self._segments = segments
        self._duration = duration
        self._segmenter = segmenter
        self._samples: int | None = None

    @property
    def duration(self) -> float | None:
        if self._samples is not None:
            return self._samples / SAMPLE_RATE
        return self._duration

    @property
    def vad_backend(self) -> str | None:
        return self._segmenter.vad_backend

    def __iter__(self) -> SegmentCutter:
        return self

    def __next__(self) -> AudioSegment:
        return next(self._segments)

    def close(self) -> None:
        """Stop decoding early and release the input."""
        close = getattr(self._segments, "close", None)
        if close is not None:
            close()

    def _finished(self, samples: int) -> None:
        self._samples = samples


def iter_segments(
    source: AudioSource,
    *,
    sample_rate: int | None = None,
    mode: SegmentMode = "vad",
    max_s: float = 30.0,
    vad: VadConfig | None = None,
    block_s: float = DEFAULT_BLOCK_S,
) -> SegmentCutter:
    """Segments of ``source`` (as for ``load_audio``), decoded as consumed; ``block_s`` changes memory and
    latency, never the result."""
    segmenter = Segmenter(mode, max_s, vad or VadConfig())
    if block_s <= 0:
        raise ValueError(f"block_s must be positive, got {block_s}")
    if isinstance(source, (tuple, np.ndarray)):
        wave = load_audio(source, sample_rate)
        cutter = SegmentCutter(iter(()), wave.size / SAMPLE_RATE, segmenter)
        cutter._segments = _from_blocks(_array_blocks(wave, block_s), segmenter, cutter)
        return cutter
    opener, name = _opener(source)
    decoder = BlockDecoder(opener, name, block_s, source.watch if isinstance(source, EncodedAudio) else None)
    cutter = SegmentCutter(iter(()), decoder.duration, segmenter)
    cutter._segments = _from_blocks(_decoded_blocks(decoder), segmenter, cutter)
    return cutter


@dataclass(frozen=True)
class Cut:
    """How one input is cut: whole (``wave``: 16 kHz samples) or as segments (``segments``)."""

    wave: np.ndarray | None
    segments: SegmentCutter | None


def cut_input(source: AudioSource, *, segmentation: str, max_s: float, vad: VadConfig | None = None,
              sample_rate: int | None = None) -> Cut:
    """Cut ``source`` by ``segmentation``: "none" whole, "vad" / "fixed" into segments, "auto" whole up to
    ``max_s`` (a file's container duration when stated), else by the VAD."""
    mode, wave, segments = segmentation, None, None
    if isinstance(source, (str, os.PathLike, EncodedAudio)):
        if mode == "auto":
            segments = iter_segments(source, mode="vad", max_s=max_s, vad=vad)
            known = segments.duration
            mode = "none" if known is not None and known <= max_s else "vad"
        if mode == "none":
            return Cut(load_audio(source), None)
    else:
        wave = load_audio(source, sample_rate)
        if mode == "auto":
            mode = "none" if len(wave) / SAMPLE_RATE <= max_s else "vad"
        if mode == "none":
            return Cut(wave, None)
    if segments is None or mode != "vad":
        segments = iter_segments(source if wave is None else (wave, SAMPLE_RATE), mode=mode,  # type: ignore[arg-type]
                               max_s=max_s, vad=vad)
    return Cut(None, segments)


def _opener(source: AudioSource) -> tuple[Callable[[], object], str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise AudioError(f"bytes input: {EMPTY_FILE}")
        return (lambda: io.BytesIO(data)), "bytes input"
    if isinstance(source, (str, os.PathLike)):
        path = checked_path(source)
        return (lambda: path), path
    if isinstance(source, EncodedAudio):
        return checked_encoded(source).opener, source.name
    raise AudioError(
        f"input of type {type(source).__name__}: unsupported audio source "
        "(expected a path, bytes, a numpy array or an (array, sample_rate) tuple)"
    )


def _array_blocks(wave: np.ndarray, block_s: float) -> Iterator[np.ndarray]:
    step = max(1, int(block_s * SAMPLE_RATE))
    for i in range(0, wave.size, step):
        yield wave[i : i + step]


def _resampled(decoder: BlockDecoder) -> Iterator[np.ndarray]:
    """One pass at 16 kHz, unscaled."""
    resampler = None
    if decoder.rate != SAMPLE_RATE:
        resampler = soxr.ResampleStream(decoder.rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
    for block in decoder.blocks():
        if not np.isfinite(block).all():
            raise AudioError(f"{decoder.name}: contains NaN or infinite samples")
        yield block if resampler is None else resampler.resample_chunk(block, last=False)
    if resampler is not None:
        yield resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


def _decoded_blocks(decoder: BlockDecoder) -> Iterator[np.ndarray]:
    """16 kHz blocks with the official amplitude rule (a first pass for the peak where samples may exceed 1)."""
    scale: np.float32 | None = None
    if decoder.rate != SAMPLE_RATE or not decoder.bounded:
        peak = 0.0
        for block in _resampled(decoder):
            if block.size:
                peak = max(peak, float(np.max(np.abs(block))))
        if peak > 1.0:
            scale = np.float32(peak)
    total = 0
    for block in _resampled(decoder):
        total += block.size
        if scale is not None:
            block = block / scale
        yield np.clip(block, -1.0, 1.0)
    if total == 0:
        raise AudioError(f"{decoder.name}: contains no audio samples")


def _from_blocks(blocks: Iterator[np.ndarray], segmenter: Segmenter, cutter: SegmentCutter) -> Iterator[AudioSegment]:
    total = 0
    for block in blocks:
        total += block.size
        yield from segmenter.feed(block)
    yield from segmenter.flush()
    cutter._finished(total)
