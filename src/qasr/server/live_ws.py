"""What both live WebSocket protocols share: admission, a serialised JSON sender, and a receive loop
that closes idle sessions, notices a drain and waits while the backlog is full. Errors are events,
then a close code (docs/streaming.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from qasr.server.auth import AUTH_VERDICT, BROWSER_KEY_PREFIX, websocket_authorized
from qasr.server.auth import offered_subprotocols as _offered
from qasr.server.live_runner import LiveRunner
from qasr.server.state import ServerState

DRAIN_POLL_S = 0.25
CLOSE_BAD_KEY, CLOSE_BAD_REQUEST, CLOSE_GOING_AWAY = 1008, 4400, 1001
DRAIN_CUT = "the server is shutting down and its drain timeout passed before this session's last audio was transcribed"


class Idle(Exception):
    """The client sent nothing for the idle timeout."""


class Draining(Exception):
    """The server is shutting down."""


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
    """Sends JSON one message at a time; receives with the idle timeout, watching the drain and backlog."""

    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws = ws
        self.state = state
        self._lock = asyncio.Lock()

    async def send(self, message: dict) -> None:
        async with self._lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(json.dumps(message, ensure_ascii=False))

    async def receive(self, busy: Callable[[], bool] = lambda: False, room: Callable[[], bool] = lambda: True) -> dict:
        """The next message (``{"text": ...}`` or ``{"bytes": ...}``); raises WebSocketDisconnect, Idle or
        Draining. Time while ``busy()`` is not idle; while ``room()`` is false nothing is read."""
        while not room():
            if self.state.draining:
                raise Draining()
            await asyncio.sleep(DRAIN_POLL_S / 5)  # a full backlog is being worked on: never idle
        if self.state.draining:
            raise Draining()
        timeout = self.state.config.live_idle_timeout_s
        waited = 0.0
        pending = asyncio.ensure_future(self.ws.receive())
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=DRAIN_POLL_S)
                if done:
                    message = pending.result()
                    if message["type"] == "websocket.disconnect":
                        raise WebSocketDisconnect(message.get("code", 1000))
                    return message
                waited = 0.0 if busy() else waited + DRAIN_POLL_S
                if self.state.draining:
                    raise Draining()
                if waited >= timeout:
                    raise Idle()
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    async def close(self, code: int = 1000, reason: str = "") -> None:
        async with self._lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await self.ws.close(code, reason[:120])


async def hold_session(state: ServerState, body: Callable[[], Awaitable[None]]) -> None:
    """Count the session as open (the limit, /metrics, the drain) while ``body`` runs."""
    state.live_sessions += 1
    state.in_flight += 1
    state.metrics.live_sessions.set(state.live_sessions)
    try:
        await body()
    finally:
        state.live_sessions -= 1
        state.in_flight -= 1
        state.metrics.live_sessions.set(state.live_sessions)


async def drain_session(runner: LiveRunner | None, state: ServerState) -> str:
    """A session's end in a drain: its audio is transcribed unless the deadline comes first. Returns the
    message of the ``shutting_down`` error that follows."""
    if runner is None or runner.failed or await runner.finish_by(state.drain_cut):
        return "the server is shutting down"
    return DRAIN_CUT
