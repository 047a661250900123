"""The server's settings, fixed at start-up (plain data: importable without the server extra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model: str  # what -m named: a directory or a hub id
    served_names: tuple[str, ...]  # the ids /v1/models lists (any model string is accepted anyway)
    api_key: str | None = None  # None: no authentication
    max_queue_audio_s: float = 3600.0  # admitted audio not yet transcribed, past which requests get 429
    max_upload_bytes: int = 100 * 2**20
    aligner: str | None = None  # a forced-aligner checkpoint, for word timestamps
    warmup: bool = True  # one short request before /health says ready
    drain_timeout_s: float = 30.0  # after SIGTERM, accepted work gets this long, then it is cut
    max_live_sessions: int = 64  # WebSocket sessions open at once
    live_idle_timeout_s: float = 60.0  # a session that sends nothing this long is closed
    live_max_backlog_s: float = 30.0  # received audio not yet processed, past which a session reads nothing
    live_chunk_s: float = 1.0  # a live step per this much audio
    # LiveConfig.end_on_chunk, on in the library; off serves many sessions better (docs/streaming.md)
    live_end_on_chunk: bool = False
    decode_workers: int = 4  # threads that probe and decode uploads, apart from live sessions' threads
    # an engine with work in hand that finishes no step this long makes /health 503; a live session whose
    # engine request goes unanswered this long ends with an error
    engine_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        from qasr.streaming.config import check_served  # here: the streaming package loads the engine

        check_served("chunk_size_sec", self.live_chunk_s, "live_chunk_s")
        if not self.engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be > 0, got {self.engine_timeout_s}")
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be at least 1, got {self.decode_workers}")
        if self.max_live_sessions < 1:
            raise ValueError(f"max_live_sessions must be at least 1, got {self.max_live_sessions}")
