"""Streaming segmentation of any audio input: segments come out while the file is still being decoded.

:func:`iter_segments` accepts every input :func:`qasr.audio.io.load_audio` accepts and yields
:class:`~qasr.audio.segments.AudioSegment` objects in order. Encoded inputs (paths, bytes) are decoded
block by block (:mod:`qasr.audio.decode_blocks`) and resampled to 16 kHz with a streaming soxr resampler,
so a two-hour file never has its whole waveform in memory, only the segmenter's window.

Exactness: a segment's samples equal the same span of ``load_audio(source)``. Streaming soxr output is
bit-identical to one-shot ``soxr.resample`` (whatever the block sizes), and channel averaging is done
per sample as load_audio does it. The official amplitude rule (divide by the peak if it exceeds 1, then
clip) needs the global peak, so inputs whose 16 kHz samples can exceed 1 (any input that is resampled,
and float codecs: mp3, AAC, Vorbis, Opus, float WAV) are decoded twice: a first pass only measures the
peak. 16 kHz integer PCM (WAV, FLAC) is read once.
"""

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
    """Iterator over an input's segments, in order; decoding happens as it is consumed.

    ``duration``: the input's duration in seconds. Before exhaustion it is what the container states
    (None when it does not say); once the iterator is exhausted it is exact (16 kHz samples / 16000).
    ``vad_backend``: the speech detector in use ("silero-onnx", "silero-jit", "energy"; None unless
    mode is "vad"). Decoding errors raise AudioError naming the input from ``next()``.
    """

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
    max_segment_s: float = 30.0,
    vad: VadConfig | None = None,
    block_s: float = DEFAULT_BLOCK_S,
) -> SegmentCutter:
    """Segments of ``source`` (see :mod:`qasr.audio.segments` for the modes), decoded as they are consumed.

    ``source`` and ``sample_rate`` are as for :func:`qasr.audio.io.load_audio` (a path, encoded bytes, an
    EncodedAudio, an array with ``sample_rate``, or an ``(array, sr)`` tuple). ``vad`` configures speech
    detection in mode "vad" (default :class:`VadConfig`). ``block_s``: seconds of audio decoded per step;
    it changes memory and latency, never the result. Arrays are converted with load_audio up front (they
    are in memory anyway); paths, bytes and EncodedAudio are decoded block by block. Input errors that
    show without decoding (missing file, undecodable container, bad array) raise AudioError here; later
    ones from iteration.
    """
    segmenter = Segmenter(mode, max_segment_s, vad or VadConfig())
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


def cut_input(source: AudioSource, *, segmentation: str, max_segment_s: float, vad: VadConfig | None = None,
              sample_rate: int | None = None) -> Cut:
    """Choose how to cut ``source`` and start: "none" decodes it whole; "vad" and "fixed" stream its
    segments; "auto" keeps an input of up to ``max_segment_s`` whole and sends a longer one through the
    VAD, reading a file's duration from its container, without decoding, where the container states it.
    Bytes and arrays are decoded in memory either way. Input errors raise AudioError (or the decoders'
    OSError / RuntimeError) here or while the stream is read."""
    mode, wave, segments = segmentation, None, None
    if isinstance(source, (str, os.PathLike, EncodedAudio)):  # an upload is decoded like a file
        if mode == "auto":
            segments = iter_segments(source, mode="vad", max_segment_s=max_segment_s, vad=vad)
            known = segments.duration
            mode = "none" if known is not None and known <= max_segment_s else "vad"
        if mode == "none":
            return Cut(load_audio(source), None)
    else:
        wave = load_audio(source, sample_rate)
        if mode == "auto":
            mode = "none" if len(wave) / SAMPLE_RATE <= max_segment_s else "vad"
        if mode == "none":
            return Cut(wave, None)
    if segments is None or mode != "vad":
        segments = iter_segments(source if wave is None else (wave, SAMPLE_RATE), mode=mode,  # type: ignore[arg-type]
                               max_segment_s=max_segment_s, vad=vad)
    return Cut(None, segments)


def _opener(source: AudioSource) -> tuple[Callable[[], object], str]:
    """A fresh-handle factory and the input's name, with load_audio's checks and messages."""
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
    """One pass over the input at 16 kHz, unscaled; rejects NaN/inf like load_audio."""
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
    """16 kHz blocks with the official amplitude rule applied, as load_audio would have produced them."""
    scale: np.float32 | None = None
    if decoder.rate != SAMPLE_RATE or not decoder.bounded:
        # First pass: the global peak decides whether every sample is divided by it.
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
