"""Draining: once a stop signal arrives, new requests get 503 while the accepted ones finish; at the
drain's deadline the ones still running are ended with an error that says why."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qasr.server import sse
from qasr.server.errors import error_body, error_response
from qasr.server.state import ServerState

CUT_MESSAGE = "the server shut down before this request finished (its drain timeout passed)"


class DrainGate:
    """Counts the requests in flight, refuses new ones (503) while the server drains, and ends the ones
    still running when the drain is cut: a 503 when no answer has begun, an ``error`` event closing a
    server-sent event stream, else the end of the body (a truncated answer the client can detect)."""

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
            if answer.get("cut"):  # a cancelled route may still answer (a 499 of its own): the cut answers
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
            if not app.done():  # cut, or this request was cancelled (its client left): the work stops too
                answer["cut"] = True
                app.cancel()
                with contextlib.suppress(BaseException):
                    await app
        if not answer.get("cut"):
            app.result()  # the request ended on its own (its exception, if any, goes on as before)
            return
        if not answer.get("started"):
            await error_response(503, CUT_MESSAGE, code="shutting_down",
                                 headers={"Connection": "close"})(scope, receive, send)
            return
        tail = sse.error_event(error_body(503, CUT_MESSAGE, code="shutting_down")) if answer.get("events") else b""
        with contextlib.suppress(Exception):  # the client may be gone
            await send({"type": "http.response.body", "body": tail, "more_body": False})
