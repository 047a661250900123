"""What the routes share: the ASR once loaded, the audio backlog, the drain, the thread pools."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from qasr.engine_process.client import RemoteEngine
from qasr.server.config import ServerConfig
from qasr.server.errors import ApiError
from qasr.server.limits import AudioBudget
from qasr.server.metrics import Metrics
from qasr.server.sse import TokenHandoff

if TYPE_CHECKING:
    from qasr.engine.engine import Engine
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
        self.drain_cut = asyncio.Event()  # set at the deadline: what is still in flight ends with an error
        self.in_flight = 0  # requests accepted and not yet answered in full (streams included)
        self.live_sessions = 0  # WebSocket live sessions open (also counted in in_flight)
        self.on_drained: Callable[[], None] | None = None  # set by the runner: stop the HTTP server
        self.started = int(time.time())  # /v1/models' "created"
        self._handoff: TokenHandoff | None = None
        # one pool per kind of tenant; a live session runs at most one operation and one close at a time
        self.decode_pool = ThreadPoolExecutor(config.decode_workers, thread_name_prefix="qasr-decode")
        self.live_pool = ThreadPoolExecutor(2 * config.max_live_sessions, thread_name_prefix="qasr-live")

    async def in_decode_pool(self, fn: Callable[[], T]) -> T:
        """``fn()`` on an upload-decoding thread."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fn)

    def close_pools(self) -> None:
        """At shutdown: no new work; running threads finish on their own."""
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.live_pool.shutdown(wait=False, cancel_futures=True)

    def start_drain(self) -> None:
        """Refuse new work; give the accepted work ``config.drain_timeout_s``. Safe in a signal handler:
        it only sets attributes."""
        if not self.draining:
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
            self.draining = True

    def drain_overdue(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def token_handoff(self) -> TokenHandoff:
        """The running loop's token handoff, shared by every streamed request."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = TokenHandoff(loop)
        return self._handoff

    def engines(self) -> dict[str, Engine | RemoteEngine]:
        """The loaded engines by role: ``asr``, and ``aligner`` with one (none while loading)."""
        if self.asr is None:
            return {}
        core = self.asr._core
        return {"asr": core.engine} | ({"aligner": core.aligner.engine} if core.aligner is not None else {})

    def engine_trouble(self) -> tuple[str, str] | None:
        """``("broken" | "stalled" | "restarting", why)`` for the first engine that cannot serve: its loop
        failed, it has had work in hand for more than ``config.engine_timeout_s`` without finishing a step, or
        its engine process is starting anew; else None."""
        for role, engine in self.engines().items():
            if isinstance(engine, RemoteEngine) and not engine.ready:
                return "restarting", (f"{role} engine restarting: its engine process ended and a new one is "
                                      "loading the model")
            stats = engine.stats()
            if stats.broken:
                return "broken", (f"{role} engine broken: its loop failed and it serves no more requests (the "
                                  "server log has the error)")
            if stats.stalled_s > self.config.engine_timeout_s:
                return "stalled", f"{role} engine stalled for {stats.stalled_s:.0f} s with work in hand"
        return None

    def engine_losses(self) -> int:
        """Engine processes that ended while serving, so far: a live session whose count changed lost its turn."""
        return sum(e.process.lost for e in self.engines().values() if isinstance(e, RemoteEngine) and e.role == "asr")

    def engine_restarts(self) -> int:
        """Engine processes started anew since the server started (0 with an in-process engine)."""
        return max((e.restarts for e in self.engines().values() if isinstance(e, RemoteEngine)), default=0)

    def require_asr(self) -> ASR:
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_not_loaded")
        if not self.ready or self.asr is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})
        return self.asr
