"""Live transcription sessions: the official re-feed streaming algorithm, computed incrementally.

``StreamConfig`` holds the settings, ``Session`` is the incremental implementation (``ASR.stream``
makes one), ``OracleStream`` the straightforward one that re-encodes everything every step (the
reference the session is tested against). See docs/streaming.md.
"""

from qasr.streaming.config import StreamConfig
from qasr.streaming.oracle import OracleStream
from qasr.streaming.session import Session, SessionStats, Update

__all__ = ["OracleStream", "Session", "SessionStats", "StreamConfig", "Update"]
