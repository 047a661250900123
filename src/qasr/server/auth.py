"""Bearer-key authentication for every route but the page and the health check."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

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
        token = bearer_token(scope["headers"])
        return token is not None and key_matches(token, self._key)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (HTTP and WebSocket alike), or None."""
    scheme, _, token = dict(headers).get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def key_matches(candidate: bytes, key: bytes) -> bool:
    # compare_digest: the time taken does not reveal how much of a guessed key was right
    return hmac.compare_digest(candidate, key)
