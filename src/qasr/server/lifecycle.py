"""Draining: after a stop signal new requests get 503, accepted ones finish or are cut at the deadline."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qasr.server import sse
from qasr.server.errors import error_body, error_response
from qasr.server.state import ServerState

CUT_MESSAGE = "the server shut down before this request finished (its drain timeout passed)"


class DrainGate:
    """Counts requests in flight, answers 503 while draining, and ends those still running at a cut: a
    503 before any answer, an ``error`` event closing an SSE stream, else the end of the body."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await error_response(503, "the server is shutting down", code="shutting_down",
                                 headers={"Connection": "close"})(scope, receive, send)
            return
        self.state.in_flight += 1  # one event loop: no lock needed
        try:
            await self._until_cut(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _until_cut(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer: dict[str, bool] = {}  # "started", "events": what the client has been sent; "cut"

        async def watch(message: Message) -> None:
            if answer.get("cut"):  # the cut answers, not the cancelled route
                return
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                answer["events"] = content_type.startswith(sse.MEDIA_TYPE.encode())
                answer["started"] = True
            await send(message)

        app = asyncio.ensure_future(self.app(scope, receive, watch))
        cut = asyncio.ensure_future(self.state.drain_cut.wait())
        try:
            await asyncio.wait({app, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            if not app.done():  # cut, or cancelled (the client left)
                answer["cut"] = True
                app.cancel()
                with contextlib.suppress(BaseException):
                    await app
        if not answer.get("cut"):
            app.result()  # ended on its own: its exception, if any, goes on
            return
        if not answer.get("started"):
            await error_response(503, CUT_MESSAGE, code="shutting_down",
                                 headers={"Connection": "close"})(scope, receive, send)
            return
        tail = sse.error_event(error_body(503, CUT_MESSAGE, code="shutting_down")) if answer.get("events") else b""
        with contextlib.suppress(Exception):  # the client may be gone
            await send({"type": "http.response.body", "body": tail, "more_body": False})
