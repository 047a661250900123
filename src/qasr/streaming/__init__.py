"""Live transcription: ``Session`` runs one turn of the official streaming algorithm incrementally
(``ASR.stream``), ``LiveSession`` cuts an endless stream into turns (``ASR.live``). See docs/streaming.md."""

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
from qasr.streaming.windows import EngineTimeout

__all__ = ["EngineTimeout", "LiveConfig", "LiveEvent", "LiveSession", "OracleStream", "PcmIngest", "Session",
           "SessionStats", "SpeechStarted", "SpeechStopped", "StreamConfig", "TurnFinal", "TurnUpdate", "Update"]
