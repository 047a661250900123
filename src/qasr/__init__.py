"""qasr: fast, exact inference for the Qwen3-ASR speech recognition models."""

from qasr.api import ASR
from qasr.audio.io import AudioError
from qasr.pieces import Piece
from qasr.results import Segment, Transcription, Word

__version__ = "0.1.0"

__all__ = ["ASR", "AudioError", "Piece", "Segment", "Transcription", "Word", "__version__"]
