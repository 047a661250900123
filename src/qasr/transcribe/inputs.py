"""From one input to its pieces: name it, decode it (a path, an upload, bytes or an array), choose how to
segment it, cut it, and build each piece's request (pieces.py).

The facade (asr.py) hands each input here once and gets its pieces back: the audio travels down from the
facade through this module into audio/ and never returns up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qasr.audio.io import SAMPLE_RATE, AudioError, EncodedAudio, checked_segments, load_audio, named_audio_error
from qasr.model.checkpoint import Checkpoint
from qasr.transcribe.pieces import Piece, make_piece, make_pieces

if TYPE_CHECKING:
    from qasr.audio.vad import VadConfig

AudioInput = str | os.PathLike | bytes | np.ndarray | tuple | EncodedAudio
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Segmenting:
    """How a call turns each of its inputs into pieces."""

    sample_rate: int | None  # of array inputs given without one
    segmentation: str  # auto, vad, fixed or none
    max_segment_s: float
    vad: VadConfig | None  # None: the detector's defaults
    max_new_tokens: int | None  # None: each piece's cap from its duration
    tokens_per_second: float
    max_chunk_sec: float  # the longest piece of an unsegmented input


class InputPieces:
    """One input's pieces as its segments are decoded; ``duration`` (seconds) is final once exhausted."""

    def __init__(self, pieces: Iterator[Piece], duration: float | None = None,
                 stream: object | None = None) -> None:
        self._pieces = pieces
        self._stream = stream  # the segment stream whose duration becomes final at its end
        self._duration = duration

    @property
    def duration(self) -> float:
        if self._duration is not None:
            return self._duration
        return float(self._stream.duration or 0.0)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Piece]:
        return self._pieces


def as_inputs(audio: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    """One input or a sequence of them, as a list (a tuple is one ``(array, sample_rate)`` input)."""
    if isinstance(audio, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, tuple, EncodedAudio)):
        return [audio]
    return list(audio)


def input_names(items: Sequence[AudioInput]) -> list[str]:
    """How messages and results name each input: its path, or "bytes input #k" / "array input #k"."""
    return [_name(item, i, len(items)) for i, item in enumerate(items)]


def _name(item: AudioInput, i: int, count: int) -> str:
    if isinstance(item, (str, os.PathLike)):
        return str(Path(item))
    if isinstance(item, EncodedAudio):
        return item.name
    kind = "bytes input" if isinstance(item, (bytes, bytearray, memoryview)) else "array input"
    return kind if count == 1 else f"{kind} #{i + 1}"


def input_pieces(checkpoint: Checkpoint, item: AudioInput, how: Segmenting, *, name: str, index: int,
                 context: str, language: str | None) -> InputPieces:
    """The pieces of input ``item``, decoded and segmented lazily; any failure is an AudioError naming it."""
    make = {"source": name, "item": index, "context": context, "language": language,
            "max_new_tokens": how.max_new_tokens, "tokens_per_second": how.tokens_per_second}
    try:
        if isinstance(item, str) and _URL.match(item):
            raise AudioError(f"{item}: URLs are not fetched; download the file and pass its path")
        mode, wave, stream = how.segmentation, None, None
        if isinstance(item, (str, os.PathLike, EncodedAudio)):  # an upload is decoded like a file
            if mode == "auto":  # the container's duration decides, without decoding the file
                stream = _segment_stream(item, "vad", how)
                known = stream.duration
                mode = "none" if known is not None and known <= how.max_segment_s else "vad"
            if mode == "none":
                wave = load_audio(item)
        else:  # bytes and arrays are decoded in memory either way
            wave = load_audio(item, how.sample_rate)
            if mode == "auto":
                mode = "none" if len(wave) / SAMPLE_RATE <= how.max_segment_s else "vad"
        if mode == "none":
            assert wave is not None
            pieces = make_pieces(checkpoint, wave, max_chunk_sec=how.max_chunk_sec, **make)
            return InputPieces(iter(pieces), duration=len(wave) / SAMPLE_RATE)
        if stream is None or mode != "vad":
            stream = _segment_stream(item if wave is None else (wave, SAMPLE_RATE), mode, how)
        segments = checked_segments(stream, name)
        pieces = (make_piece(checkpoint, seg.samples, offset=seg.start, duration=seg.end - seg.start, **make)
                  for seg in segments)
        return InputPieces(pieces, stream=stream)
    except ValueError as exc:  # AudioError included
        raise named_audio_error(exc, name) from exc
    except (OSError, RuntimeError) as exc:  # a decoder or the detector failing on this input alone
        raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc


def _segment_stream(item: object, mode: str, how: Segmenting):  # noqa: ANN202
    """The segment stream of one input (imported here: the VAD's runtime loads only when segmenting)."""
    from qasr.audio.stream import iter_segments

    extra = {} if how.vad is None else {"vad": how.vad}
    return iter_segments(item, sample_rate=None, mode=mode, max_segment_s=how.max_segment_s, **extra)
