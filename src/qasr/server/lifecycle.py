"""Draining: once a stop signal arrives, new requests get 503 while the accepted ones finish."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from qasr.server.errors import error_response
from qasr.server.state import ServerState


class DrainGate:
    """Counts the requests in flight and refuses new ones (503) while the server drains."""

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
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
