"""Bearer-key authentication for every route but the page and the health check."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from qasr.server.errors import error_response

OPEN_PATHS = frozenset({"/", "/favicon.ico", "/health"})  # the page (it asks for the key itself), its icon
# (browsers fetch it unasked) and load balancers' probe


class ApiKeyAuth:
    """Answers 401 unless ``Authorization: Bearer <key>`` matches; the key is never logged or echoed."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken does not reveal how much of a guessed key was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
