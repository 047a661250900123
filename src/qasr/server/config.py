"""The server's settings, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model: str  # what -m named: a directory or a hub id
    served_names: tuple[str, ...]  # the ids /v1/models lists (any model string is accepted anyway)
    api_key: str | None = None  # None: no authentication
    max_queue_audio_s: float = 3600.0  # audio admitted and not yet transcribed, beyond which requests get 429
    max_upload_bytes: int = 100 * 2**20
    aligner: str | None = None  # --aligner: a forced-aligner checkpoint, for word timestamps
    warmup: bool = True  # one short request before /health says ready
    drain_timeout_s: float = 30.0  # SIGTERM: the accepted work gets this long to finish, then it is cut
    # live sessions (WebSocket /v1/realtime and /v1/stream)
    max_live_sessions: int = 64  # open at once; more are refused with an error event
    live_idle_timeout_s: float = 60.0  # a session that sends nothing for this long is closed and freed
    live_max_backlog_s: float = 30.0  # audio received and not yet processed, beyond which appends are refused
    live_chunk_s: float = 1.0  # a step per this much audio (the official default is 2.0; 1.0 for captions)
    # whether a paused turn ends at its chunk boundary (LiveConfig.end_on_chunk, on in the library): better for one
    # session on a small machine, worse in three measured pairs where 16 sessions, a file and HTTP clients share
    # the engine (docs/streaming.md), which is what a server is for; /v1/stream's start message may override it
    live_end_on_chunk: bool = False
    # uploads are probed and decoded on this many threads of their own (more wait their turn), so a burst of
    # uploads never takes the threads live sessions run on, nor those of the event loop's default executor
    decode_workers: int = 4

    def __post_init__(self) -> None:
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be at least 1, got {self.decode_workers}")
        if self.max_live_sessions < 1:
            raise ValueError(f"max_live_sessions must be at least 1, got {self.max_live_sessions}")
