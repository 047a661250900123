"""The old import path of the ASR facade: ``from qasr.api import ASR`` keeps working (transcribe/asr.py)."""

from qasr.transcribe.asr import ASR, SEGMENTATIONS, TIMESTAMPS, AudioInput, Outcome

__all__ = ["ASR", "SEGMENTATIONS", "TIMESTAMPS", "AudioInput", "Outcome"]
