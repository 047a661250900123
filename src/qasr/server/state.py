"""What the routes share: the loaded ASR (once ready), the backlog, the drain (its flag and deadline),
requests in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from qasr.server.config import ServerConfig
from qasr.server.errors import ApiError
from qasr.server.limits import AudioBudget
from qasr.server.metrics import Metrics
from qasr.server.sse import TokenHandoff

if TYPE_CHECKING:
    from qasr.transcribe.asr import ASR

T = TypeVar("T")


class ServerState:
    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.budget = AudioBudget(config.max_queue_audio_s)
        self.asr: ASR | None = None
        self.ready = False  # loaded and warmed up
        self.load_error: str | None = None
        self.draining = False  # SIGTERM/SIGINT: refuse new requests, finish the accepted ones
        self.drain_deadline: float | None = None  # time.monotonic() by which the drain ends, done or not
        # set by the drain's watcher at the deadline: what is still in flight ends with an error, now
        self.drain_cut = asyncio.Event()
        self.in_flight = 0  # requests accepted and not yet answered in full (streams included)
        self.live_sessions = 0  # WebSocket live sessions open (also counted in in_flight)
        self.on_drained: Callable[[], None] | None = None  # set by the runner: stop the HTTP server
        self.started = int(time.time())  # /v1/models' "created"
        self._handoff: TokenHandoff | None = None
        # Two bounded pools, one per kind of tenant, instead of the loop's shared default executor: uploads'
        # probing and decoding on ``decode_workers`` threads; live sessions' operations on their own, at
        # most one operation plus one close per session at a time, so no session waits for another's thread.
        self.decode_pool = ThreadPoolExecutor(config.decode_workers, thread_name_prefix="qasr-decode")
        self.live_pool = ThreadPoolExecutor(2 * config.max_live_sessions, thread_name_prefix="qasr-live")

    async def in_decode_pool(self, fn: Callable[[], T]) -> T:
        """``fn()`` on an upload-decoding thread."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fn)

    def close_pools(self) -> None:
        """At shutdown: no new work; threads still running finish on their own (they are not joined)."""
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.live_pool.shutdown(wait=False, cancel_futures=True)

    def start_drain(self) -> None:
        """Refuse new work and give the accepted work ``config.drain_timeout_s`` to finish. Called from
        a signal handler: it only sets plain attributes (the watcher on the loop does the rest)."""
        if not self.draining:
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
            self.draining = True

    def drain_overdue(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def token_handoff(self) -> TokenHandoff:
        """The one token handoff of the running loop, shared by every streamed request."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = TokenHandoff(loop)
        return self._handoff

    def require_asr(self) -> ASR:
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_not_loaded")
        if not self.ready or self.asr is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})
        return self.asr
