"""Live transcription sessions: the official re-feed streaming algorithm, computed incrementally.

``StreamConfig`` holds the settings, ``Session`` is the incremental implementation (``ASR.stream``
makes one), ``LiveSession`` cuts an endless stream into turns of Sessions (``ASR.live``),
``PcmIngest`` turns wire PCM into 16 kHz samples, ``OracleStream`` is the straightforward algorithm
that re-encodes everything every step (the reference the session is tested against). See docs/streaming.md.
"""

from qasr.streaming.config import LiveConfig, StreamConfig
from qasr.streaming.ingest import PcmIngest
from qasr.streaming.live import (
    LiveEvent,
    LiveSession,
    SpeechStarted,
    SpeechStopped,
    TurnFinal,
    TurnUpdate,
)
from qasr.streaming.oracle import OracleStream
from qasr.streaming.session import Session, SessionStats, Update

__all__ = ["LiveConfig", "LiveEvent", "LiveSession", "OracleStream", "PcmIngest", "Session", "SessionStats",
           "SpeechStarted", "SpeechStopped", "StreamConfig", "TurnFinal", "TurnUpdate", "Update"]
