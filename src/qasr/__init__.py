"""qasr: fast, exact inference for the Qwen3-ASR speech recognition models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public names load on first use (PEP 562), so `qasr --help`, `--version` and usage errors answer
# without importing torch.
_HOMES = {"ASR": "qasr.transcribe.asr", "Aligner": "qasr.align.aligner", "AudioError": "qasr.audio.io",
          "EngineConfig": "qasr.engine.config", "LiveConfig": "qasr.streaming", "Piece": "qasr.transcribe.pieces",
          "Segment": "qasr.results", "SegmentIterator": "qasr.transcribe.asr", "StreamConfig": "qasr.streaming",
          "TranscribeOptions": "qasr.transcribe.options", "Transcription": "qasr.results",
          "TranscriptionFailed": "qasr.transcribe.asr", "VadConfig": "qasr.audio.vad", "Word": "qasr.results"}

__all__ = ["ASR", "Aligner", "AudioError", "EngineConfig", "LiveConfig", "Piece", "Segment", "SegmentIterator",
           "StreamConfig", "TranscribeOptions", "Transcription", "TranscriptionFailed", "VadConfig", "Word",
           "__version__"]

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.audio.io import AudioError
    from qasr.audio.vad import VadConfig
    from qasr.engine.config import EngineConfig
    from qasr.results import Segment, Transcription, Word
    from qasr.streaming import LiveConfig, StreamConfig
    from qasr.transcribe.asr import ASR, SegmentIterator, TranscriptionFailed
    from qasr.transcribe.options import TranscribeOptions
    from qasr.transcribe.pieces import Piece


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'qasr' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
