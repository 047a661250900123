"""A call's inputs and their pieces: name each input, decode it, cut it, build its pieces."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qasr.audio.cutting import SegmentCutter
from qasr.audio.features import LogMel
from qasr.audio.io import SAMPLE_RATE, AudioError, EncodedAudio, checked_segments, named_audio_error
from qasr.model.checkpoint import Checkpoint
from qasr.transcribe.options import TranscribeOptions, model_language
from qasr.transcribe.options import cut as cut_input
from qasr.transcribe.pieces import Piece, make_piece, make_pieces

log = logging.getLogger(__name__)

AudioInput = str | os.PathLike | bytes | np.ndarray | tuple | EncodedAudio
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def canonical_language(lang: str | None, supported: Sequence[str]) -> str | None:
    """A language name or ISO code, canonical (None: detect); ValueError when not ``supported``."""
    return model_language(lang, supported)


@dataclass(frozen=True)
class Call:
    checkpoint: Checkpoint
    items: list[AudioInput]
    names: list[str]
    languages: list[str | None]  # canonical names
    contexts: list[str]
    options: TranscribeOptions  # for_model
    tokens_per_second: float
    max_chunk_sec: float
    words: bool  # asked for, and an aligner is loaded
    log_mel: LogMel | None = None  # each piece's features made with it (None: the engine makes them)

    def pieces_of(self, i: int) -> InputPieces:
        """Input ``i``'s pieces, cut lazily; AudioError names the input."""
        item, name, o = self.items[i], self.names[i], self.options
        make = {"source": name, "item": i, "context": self.contexts[i], "language": self.languages[i],
                "max_new_tokens": o.max_new_tokens, "tokens_per_second": self.tokens_per_second,
                "log_mel": self.log_mel}
        try:
            if isinstance(item, str) and _URL.match(item):
                raise AudioError(f"{item}: URLs are not fetched; download the file and pass its path")
            cut = cut_input(item, o)
            if cut.wave is not None:
                pieces = make_pieces(self.checkpoint, cut.wave, max_chunk_sec=self.max_chunk_sec, **make)
                return InputPieces(iter(pieces), duration=len(cut.wave) / SAMPLE_RATE)
            assert cut.segments is not None
            pieces = (make_piece(self.checkpoint, seg.samples, offset=seg.start, duration=seg.end - seg.start, **make)
                      for seg in checked_segments(cut.segments, name))
            return InputPieces(pieces, segments=cut.segments)
        except ValueError as exc:  # AudioError included
            raise named_audio_error(exc, name) from exc
        except (OSError, RuntimeError) as exc:  # a decoder or the detector failing on this input
            raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc


def plan_call(checkpoint: Checkpoint, audio: AudioInput | Sequence[AudioInput], options: TranscribeOptions, *,
              supported: Sequence[str], aligner: bool, tokens_per_second: float, max_chunk_sec: float,
              log_mel: LogMel | None = None) -> Call:
    items = as_inputs(audio)
    languages = [canonical_language(lang, supported) for lang in _broadcast(options.language, len(items), "language")]
    contexts = [c or "" for c in _broadcast(options.context, len(items), "context")]
    words = options.words
    if words and not aligner:
        log.warning("word timestamps need a forced aligner (ASR.from_pretrained(..., aligner=PATH), or "
                    "--aligner PATH): giving segment times instead")
        words = False
    return Call(checkpoint, items, input_names(items), languages, contexts, options, tokens_per_second,
                max_chunk_sec, words, log_mel)


def _broadcast(value: object, n: int, what: str) -> list:
    if value is None or isinstance(value, str):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what}: got {len(values)} values for {n} inputs")
    return values


class InputPieces:
    def __init__(self, pieces: Iterator[Piece], duration: float | None = None,
                 segments: SegmentCutter | None = None) -> None:
        self._pieces = pieces
        self._segments = segments  # its duration is final once they end
        self._duration = duration

    @property
    def duration(self) -> float:
        if self._duration is not None:
            return self._duration
        return float(self._segments.duration or 0.0)

    def __iter__(self) -> Iterator[Piece]:
        return self._pieces


def as_inputs(audio: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    """A list of inputs (a tuple is one ``(array, sample_rate)`` input)."""
    if isinstance(audio, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, tuple, EncodedAudio)):
        return [audio]
    return list(audio)


def input_names(items: Sequence[AudioInput]) -> list[str]:
    """Each input's name: its path, or "bytes input #k" / "array input #k"."""
    return [_name(item, i, len(items)) for i, item in enumerate(items)]


def _name(item: AudioInput, i: int, count: int) -> str:
    if isinstance(item, (str, os.PathLike)):
        return str(Path(item))
    if isinstance(item, EncodedAudio):
        return item.name
    kind = "bytes input" if isinstance(item, (bytes, bytearray, memoryview)) else "array input"
    return kind if count == 1 else f"{kind} #{i + 1}"
