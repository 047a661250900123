"""What both live WebSocket protocols share: admission, a serialised JSON sender, and a receive loop
that reads ahead (pings stay answered), closes idle sessions, notices a drain or a client gone, and
waits while the backlog is full. Errors are events, then a close code (docs/streaming.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from qasr.server.auth import AUTH_VERDICT, BROWSER_KEY_PREFIX, websocket_authorized
from qasr.server.auth import offered_subprotocols as _offered
from qasr.server.live_runner import LiveRunner
from qasr.server.state import ServerState
from qasr.streaming import EngineTimeout

DRAIN_POLL_S = 0.25
MAX_UNREAD_BYTES = 16 * 2**20  # read ahead of a session's backlog; then reading pauses (uvicorn's ws_max_size)
CLOSE_BAD_KEY, CLOSE_BAD_REQUEST, CLOSE_GOING_AWAY = 1008, 4400, 1001
DRAIN_CUT = "the server is shutting down and its drain timeout passed before this session's last audio was transcribed"


class Idle(Exception):
    """The client sent nothing for the idle timeout."""


class Draining(Exception):
    """The server is shutting down."""


class EngineLost(RuntimeError):
    """The engine process ended while the session was open: its turn went with it (a new one serves new
    sessions)."""


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    close_code: int


def offered_subprotocols(ws: WebSocket) -> list[str]:
    return _offered(ws.scope)


def refusal(ws: WebSocket, state: ServerState) -> Refusal | None:
    """Why this connection cannot have a live session now (None: it can)."""
    key = state.config.api_key
    if key and not _authorized(ws, key):
        return Refusal("invalid_api_key", "missing or wrong API key: send 'Authorization: Bearer KEY' (or, from "
                       f"a browser, the subprotocol '{BROWSER_KEY_PREFIX}KEY')", CLOSE_BAD_KEY)
    if state.draining:
        return Refusal("shutting_down", "the server is shutting down", 1013)
    if state.load_error is not None:
        return Refusal("model_not_loaded", f"the model failed to load: {state.load_error}", 1011)
    if not state.ready or state.asr is None:
        return Refusal("model_loading", "the model is still loading; retry shortly", 1013)
    if state.live_sessions >= state.config.max_live_sessions:
        return Refusal("too_many_sessions", f"this server holds at most {state.config.max_live_sessions} live "
                       "sessions at once (--max-live-sessions); retry later", 1013)
    return None


def _authorized(ws: WebSocket, key: str) -> bool:
    verdict = ws.scope.get(AUTH_VERDICT)  # ApiKeyAuth's (auth.py)
    return verdict if verdict is not None else websocket_authorized(ws.scope, key.encode())


class Channel:
    """Sends JSON one message at a time; reads ahead of ``receive`` (pings stay answered while audio waits).
    A send that fails or cannot finish within the idle timeout means the client is gone."""

    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws = ws
        self.state = state
        self._lock = asyncio.Lock()
        self.gone: int | None = None  # the close code, once the client left
        self._unread: deque[dict] = deque()
        self._unread_bytes = 0
        self._arrived = asyncio.Event()  # a message came, or the client left
        self._taken = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self._engine_losses = state.engine_losses()

    async def send(self, message: dict) -> None:
        async with self._lock:
            if self.gone is not None:
                raise WebSocketDisconnect(self.gone)
            if self.ws.application_state != WebSocketState.CONNECTED:
                return
            try:
                await asyncio.wait_for(self.ws.send_text(json.dumps(message, ensure_ascii=False)),
                                       self.state.config.live_idle_timeout_s)
            except (OSError, RuntimeError, TimeoutError, WebSocketDisconnect) as exc:
                self._left(1006)
                raise WebSocketDisconnect(1006) from exc

    async def receive(self, busy: Callable[[], bool] = lambda: False, room: Callable[[], bool] = lambda: True) -> dict:
        """The next message (``{"text": ...}`` or ``{"bytes": ...}``) once ``room()``; raises
        WebSocketDisconnect, Idle, Draining or EngineLost. Time while ``busy()`` or without room is not idle."""
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            self._arrived.clear()
            if self.gone is not None:
                raise WebSocketDisconnect(self.gone)
            if self.state.draining:
                raise Draining()
            if self.state.engine_losses() != self._engine_losses:
                raise EngineLost("the engine process ended (the server log says why); a new one is starting")
            has_room = room()
            if has_room and self._unread:
                message = self._unread.popleft()
                self._unread_bytes -= _size(message)
                self._taken.set()
                return message
            if busy() or not has_room:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= self.state.config.live_idle_timeout_s:
                raise Idle()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), DRAIN_POLL_S if has_room else DRAIN_POLL_S / 5)

    async def _read(self) -> None:
        try:
            while True:
                while self._unread_bytes >= MAX_UNREAD_BYTES:
                    self._taken.clear()
                    await self._taken.wait()
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    self._left(message.get("code", 1000))
                    return
                self._unread.append(message)
                self._unread_bytes += _size(message)
                self._arrived.set()
        except Exception:  # noqa: BLE001 - a connection starlette no longer reads: gone
            self._left(1006)

    def _left(self, code: int) -> None:
        if self.gone is None:
            self.gone = code
        self._arrived.set()

    async def stop(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._unread.clear()
        self._unread_bytes = 0

    async def close(self, code: int = 1000, reason: str = "") -> None:
        async with self._lock:
            if self.gone is None and self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await asyncio.wait_for(self.ws.close(code, reason[:120]), self.state.config.live_idle_timeout_s)


def _size(message: dict) -> int:
    return len(message.get("bytes") or b"") + len(message.get("text") or "")


async def hold_session(state: ServerState, channel: Channel, body: Callable[[], Awaitable[None]]) -> None:
    """Count the session as open (the limit, /metrics, the drain) while ``body`` runs; then stop reading."""
    state.live_sessions += 1
    state.in_flight += 1
    state.metrics.live_sessions.set(state.live_sessions)
    try:
        await body()
    finally:
        try:
            await channel.stop()
        finally:
            state.live_sessions -= 1
            state.in_flight -= 1
            state.metrics.live_sessions.set(state.live_sessions)


def failure_message(exc: Exception) -> str:
    """The ``server_error`` message of a session whose operation raised ``exc`` (the session then closes)."""
    if isinstance(exc, EngineTimeout):
        return f"{exc}: the session is closed"
    return f"transcription failed: {type(exc).__name__}: {exc}"


async def unless_gone(sending: Awaitable[None]) -> None:
    """``await sending``, unless the client is gone."""
    with contextlib.suppress(WebSocketDisconnect):
        await sending


async def end_session(runner: LiveRunner | None) -> None:
    """Free the session, unless a cut drain's close is under way."""
    if runner is not None and not runner.closing:
        await runner.close()


async def drain_session(runner: LiveRunner | None, state: ServerState) -> str:
    """A session's end in a drain: its audio is transcribed unless the deadline comes first. Returns the
    message of the ``shutting_down`` error that follows."""
    if runner is None or runner.failed or await runner.finish_by(state.drain_cut):
        return "the server is shutting down"
    return DRAIN_CUT
