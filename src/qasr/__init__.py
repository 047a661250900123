"""qasr: fast, exact inference for the Qwen3-ASR speech recognition models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public names load on first use (PEP 562), so `qasr --help`, `--version` and usage errors answer
# without importing torch.
_HOMES = {"ASR": "qasr.transcribe.asr", "Aligner": "qasr.align.aligner", "AudioError": "qasr.audio.io",
          "Piece": "qasr.transcribe.pieces", "Segment": "qasr.results", "Transcription": "qasr.results",
          "Word": "qasr.results", "SegmentStream": "qasr.transcribe.segment_stream",
          "TranscriptionFailed": "qasr.transcribe.segment_stream"}

__all__ = ["ASR", "Aligner", "AudioError", "Piece", "Segment", "SegmentStream", "Transcription",
           "TranscriptionFailed", "Word", "__version__"]

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.audio.io import AudioError
    from qasr.results import Segment, Transcription, Word
    from qasr.transcribe.asr import ASR
    from qasr.transcribe.pieces import Piece
    from qasr.transcribe.segment_stream import SegmentStream, TranscriptionFailed


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'qasr' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
