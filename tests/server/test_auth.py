"""Authentication is default-deny: with an API key, every route, HTTP and WebSocket, needs
it except the public ones (the page, its icon, the health check). The routes are enumerated from the app,
so a route added later is covered without editing this test; two routes added here without any check of
their own (one WebSocket, one HTTP) must be refused too. A real uvicorn server on 127.0.0.1; the model
never loads (authentication comes before it)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
import websockets
from fastapi import WebSocket
from fastapi.routing import APIWebSocketRoute
from server_proc import free_port
from starlette.routing import WebSocketRoute

from qasr.server.app import create_app
from qasr.server.config import ServerConfig

KEY = "tenant-secret"
PUBLIC = {"/", "/favicon.ico", "/health"}  # today's public set, exactly
LIVE = {"/v1/realtime", "/v1/stream"}  # they report a refusal in their own protocol: an error event, then 1008


@pytest.fixture(scope="module")
def served():  # noqa: ANN201
    release = threading.Event()

    def load():  # noqa: ANN202 - the model stays "loading" for the whole module
        release.wait(120)
        raise RuntimeError("no model in this test")

    app = create_app(ServerConfig(model="m", served_names=("m",), api_key=KEY, warmup=False), load)

    async def unguarded_ws(ws: WebSocket) -> None:  # a new route that forgot to check the key
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    async def unguarded_http() -> dict:
        return {"hello": "world"}

    app.add_api_websocket_route("/v1/unguarded", unguarded_ws)
    app.add_api_route("/v1/unguarded-http", unguarded_http, methods=["GET"])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def leaf_routes(routes: list, prefix: str = "") -> list[tuple[str, object]]:
    """(full path, route) of every endpoint, through included routers (FastAPI keeps those as one
    entry of ``app.routes`` each, with their routes inside)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            out += leaf_routes(inner.routes, prefix + getattr(context, "prefix", ""))
        else:
            out.append((prefix + route.path, route))
    return out


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


async def ws_outcome(url: str, headers: dict | None = None, subprotocols: list[str] | None = None) -> tuple:
    """('refused', HTTP status) for a refused handshake, else ('open', first message, close code)."""
    try:
        async with websockets.connect(url, additional_headers=headers, subprotocols=subprotocols,
                                      open_timeout=10) as ws:
            first = await asyncio.wait_for(ws.recv(), 10)
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return "open", first, ws.close_code
    except websockets.InvalidStatus as exc:
        return "refused", exc.response.status_code


def error_code(message: str) -> str:
    event = json.loads(message)
    return (event.get("error") or event)["code"]  # the realtime protocol nests it, the native one does not


def test_every_route_keeps_its_public_or_private_status(served) -> None:
    app, url = served
    auth = {"Authorization": f"Bearer {KEY}"}
    ws_paths, http_seen = set(), set()
    routes = leaf_routes(app.routes)
    assert len(routes) >= 12  # the app's 10 and the 2 added here: the walk found them all
    for full, route in routes:
        path = concrete(full)
        if isinstance(route, (APIWebSocketRoute, WebSocketRoute)):
            ws_paths.add(full)
            continue
        for method in sorted(route.methods - {"HEAD"}):
            http_seen.add(full)
            bare = httpx.request(method, url + path, timeout=10).status_code
            keyed = httpx.request(method, url + path, headers=auth, timeout=10).status_code
            if full in PUBLIC:
                assert bare != 401, f"{method} {full} is public today"
            else:
                assert bare == 401, f"{method} {full} answered {bare} without the key"
                assert keyed != 401, f"{method} {full} refused the key"
    assert PUBLIC <= http_seen and "/v1/unguarded-http" in http_seen
    assert ws_paths >= LIVE | {"/v1/unguarded"}

    async def check_websockets() -> None:
        wsurl = url.replace("http://", "ws://")
        for path in sorted(ws_paths):
            bare = await ws_outcome(wsurl + concrete(path))
            if path in LIVE:  # today's answer to a missing key: an error event in the protocol, then 1008
                assert bare[0] == "open" and error_code(bare[1]) == "invalid_api_key" and bare[2] == 1008, path
            else:
                assert bare == ("refused", 401), f"WebSocket {path} without the key: {bare}"
            for keyed in (await ws_outcome(wsurl + concrete(path), headers=auth),
                          await ws_outcome(wsurl + concrete(path),  # a browser's way: the key as a subprotocol
                                           subprotocols=[f"openai-insecure-api-key.{KEY}"])):
                assert keyed[0] == "open", f"WebSocket {path} refused the key: {keyed}"
                if path in LIVE:
                    assert error_code(keyed[1]) == "model_loading" and keyed[2] == 1013
                else:
                    assert keyed[1] == "hello"

    asyncio.run(check_websockets())


def test_a_wrong_key_is_refused_on_websockets_too(served) -> None:
    _, url = served
    wsurl = url.replace("http://", "ws://")

    async def run() -> list:
        wrong = {"Authorization": "Bearer not-the-key"}
        return [await ws_outcome(wsurl + "/v1/unguarded", headers=wrong),
                await ws_outcome(wsurl + "/v1/unguarded", subprotocols=["openai-insecure-api-key.nope"]),
                await ws_outcome(wsurl + "/v1/stream", headers=wrong)]

    unguarded, browser, live = asyncio.run(run())
    assert unguarded == ("refused", 401) and browser == ("refused", 401)
    assert live[0] == "open" and error_code(live[1]) == "invalid_api_key" and live[2] == 1008
