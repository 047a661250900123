"""qasr: fast, exact inference for the Qwen3-ASR speech recognition models."""

from qasr.api import ASR
from qasr.results import Segment, Transcription, Word

__version__ = "0.1.0"

__all__ = ["ASR", "Segment", "Transcription", "Word", "__version__"]
