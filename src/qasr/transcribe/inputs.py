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

from qasr.audio.io import SAMPLE_RATE, AudioError, EncodedAudio, checked_segments, named_audio_error
from qasr.audio.stream import cut_input
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
        cut = cut_input(item, segmentation=how.segmentation, max_segment_s=how.max_segment_s, vad=how.vad,
                        sample_rate=how.sample_rate)
        if cut.wave is not None:
            pieces = make_pieces(checkpoint, cut.wave, max_chunk_sec=how.max_chunk_sec, **make)
            return InputPieces(iter(pieces), duration=len(cut.wave) / SAMPLE_RATE)
        assert cut.stream is not None
        segments = checked_segments(cut.stream, name)
        pieces = (make_piece(checkpoint, seg.samples, offset=seg.start, duration=seg.end - seg.start, **make)
                  for seg in segments)
        return InputPieces(pieces, stream=cut.stream)
    except ValueError as exc:  # AudioError included
        raise named_audio_error(exc, name) from exc
    except (OSError, RuntimeError) as exc:  # a decoder or the detector failing on this input alone
        raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc
