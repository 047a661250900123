"""Bearer-key authentication, default-deny: every route needs the key except ``PUBLIC_PATHS``. The
live routes get the verdict (``AUTH_VERDICT``) and refuse in their own protocol; other WebSockets get a
401 handshake answer or close code 1008.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from qasr.server.errors import error_response

PUBLIC_PATHS = frozenset({"/", "/favicon.ico", "/health"})  # the page, its icon, load balancers' probe
OWN_REFUSAL_PATHS = frozenset({"/v1/realtime", "/v1/stream"})
AUTH_VERDICT = "qasr.authorized"  # scope key of the verdict on a WebSocket let through
BROWSER_KEY_PREFIX = "openai-insecure-api-key."  # a subprotocol: browsers cannot set headers
MESSAGE = "missing or wrong API key: send the header 'Authorization: Bearer KEY'"


class ApiKeyAuth:
    """Answers 401 unless ``Authorization: Bearer <key>`` matches (on a WebSocket, also the subprotocol
    ``openai-insecure-api-key.<key>``); the key is never logged or echoed."""

    def __init__(self, app: ASGIApp, api_key: str, public: Iterable[str] = PUBLIC_PATHS,
                 own_refusal: Iterable[str] = OWN_REFUSAL_PATHS) -> None:
        self.app = app
        self._key = api_key.encode()
        self._public = frozenset(public)
        self._own_refusal = frozenset(own_refusal)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in self._public:  # lifespan, public routes
            await self.app(scope, receive, send)
            return
        if kind == "http":
            if key_matches_any([bearer_token(scope["headers"])], self._key):
                await self.app(scope, receive, send)
                return
            response = error_response(401, MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        authorized = websocket_authorized(scope, self._key)
        if authorized or scope["path"] in self._own_refusal:
            await self.app({**scope, AUTH_VERDICT: authorized}, receive, send)
            return
        await _refuse_websocket(scope, receive, send)


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    ws = WebSocket(scope, receive, send)
    if "websocket.http.response" in scope.get("extensions", {}):  # a real HTTP answer to the handshake
        await ws.send_denial_response(error_response(401, MESSAGE, code="invalid_api_key",
                                                     headers={"WWW-Authenticate": "Bearer"}))
    else:
        await ws.close(1008)  # the handshake is refused (HTTP 403)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (HTTP and WebSocket alike), or None."""
    scheme, _, token = dict(headers).get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def offered_subprotocols(scope: Scope) -> list[str]:
    header = dict(scope.get("headers") or []).get(b"sec-websocket-protocol", b"").decode("latin-1")
    return [p.strip() for p in header.split(",") if p.strip()]


def websocket_authorized(scope: Scope, key: bytes) -> bool:
    """The key in the Authorization header, or in the subprotocol BROWSER_KEY_PREFIX + key."""
    candidates = [bearer_token(scope.get("headers") or [])]
    candidates += [p[len(BROWSER_KEY_PREFIX):].encode() for p in offered_subprotocols(scope)
                   if p.startswith(BROWSER_KEY_PREFIX)]
    return key_matches_any(candidates, key)


def key_matches_any(candidates: Iterable[bytes | None], key: bytes) -> bool:
    return any(c is not None and key_matches(c, key) for c in candidates)


def key_matches(candidate: bytes, key: bytes) -> bool:
    # constant time: the time taken does not tell how much of a guess was right
    return hmac.compare_digest(candidate, key)
