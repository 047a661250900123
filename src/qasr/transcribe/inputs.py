"""A call's inputs and their pieces: check the call's options, name each input, then decode it (a path, an
upload, bytes or an array), choose how to segment it, cut it, and build each piece's request (pieces.py).

The facade (asr.py) plans a call here once (``plan_call``) and the feed asks the plan for each input's
pieces (``Call.pieces_of``): the audio travels down from the facade through this module into audio/.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qasr.audio.io import SAMPLE_RATE, AudioError, EncodedAudio, checked_segments, named_audio_error
from qasr.audio.cutting import cut_input
from qasr.model.checkpoint import Checkpoint
from qasr.model.prompt import normalize_language
from qasr.transcribe.pieces import Piece, make_piece, make_pieces

if TYPE_CHECKING:
    from qasr.audio.vad import VadConfig

log = logging.getLogger(__name__)

AudioInput = str | os.PathLike | bytes | np.ndarray | tuple | EncodedAudio
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
SEGMENTATIONS = ("auto", "vad", "fixed", "none")
TIMESTAMPS = ("segment", "word")


def check_options(max_new_tokens: int | None, segmentation: str, max_segment_s: float, timestamps: str) -> None:
    """The checks of a call's options that need no model: ``transcribe`` and the Ray job make them before any
    work starts (ValueError naming the option)."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {', '.join(SEGMENTATIONS)}, got {segmentation!r}")
    if not max_segment_s > 0:
        raise ValueError(f"max_segment_s must be positive, got {max_segment_s}")
    if timestamps not in TIMESTAMPS:
        raise ValueError(f"timestamps must be one of {', '.join(TIMESTAMPS)}, got {timestamps!r}")


def canonical_language(lang: str | None, supported: Sequence[str]) -> str | None:
    """The canonical name of a language name or ISO code (None for None or blank: detect); ValueError listing
    ``supported`` when it is not among them."""
    name = normalize_language(lang)
    if name is not None and name not in supported:
        raise ValueError(f"language {lang!r} is not supported by this model; supported: {', '.join(supported)}")
    return name


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


@dataclass(frozen=True)
class Call:
    """One call's inputs with their names and per-input options, checked before any audio is touched."""

    checkpoint: Checkpoint
    items: list[AudioInput]
    names: list[str]  # how messages and results name each input
    languages: list[str | None]  # canonical names
    contexts: list[str]
    how: Segmenting
    words: bool  # word timestamps requested and an aligner loaded

    def pieces_of(self, i: int) -> InputPieces:
        """Input ``i``'s pieces, decoded and segmented lazily; any failure is an AudioError naming the input."""
        return input_pieces(self.checkpoint, self.items[i], self.how, name=self.names[i], index=i,
                            context=self.contexts[i], language=self.languages[i])


def plan_call(checkpoint: Checkpoint, audio: AudioInput | Sequence[AudioInput], *, language: str | None | Sequence,
              context: str | Sequence[str], how: Segmenting, timestamps: str, supported: Sequence[str],
              aligner: bool) -> Call:
    """Check a call and fix each input's name and options (a scalar applies to every input, a list goes
    item by item). ``aligner``: one is loaded, so word timestamps can be given."""
    check_options(how.max_new_tokens, how.segmentation, how.max_segment_s, timestamps)
    items = as_inputs(audio)
    languages = [canonical_language(lang, supported) for lang in _broadcast(language, len(items), "language")]
    contexts = [c or "" for c in _broadcast(context, len(items), "context")]
    words = timestamps == "word"
    if words and not aligner:
        log.warning("word timestamps need a forced aligner (ASR.from_pretrained(..., aligner=PATH), or "
                    "--aligner PATH): giving segment times instead")
        words = False
    return Call(checkpoint, items, input_names(items), languages, contexts, how, words)


def _broadcast(value: object, n: int, what: str) -> list:
    if value is None or isinstance(value, str):
        return [value] * n
    values = list(value)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"{what}: got {len(values)} values for {n} inputs")
    return values


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
        assert cut.segments is not None
        segments = checked_segments(cut.segments, name)
        pieces = (make_piece(checkpoint, seg.samples, offset=seg.start, duration=seg.end - seg.start, **make)
                  for seg in segments)
        return InputPieces(pieces, stream=cut.segments)
    except ValueError as exc:  # AudioError included
        raise named_audio_error(exc, name) from exc
    except (OSError, RuntimeError) as exc:  # a decoder or the detector failing on this input alone
        raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc
