"""The app factory: routes, middleware, and the model loaded in a worker thread once the server listens."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI

from qasr.engine_process.client import RemoteEngine
from qasr.server.auth import ApiKeyAuth
from qasr.server.config import ServerConfig
from qasr.server.errors import install_handlers
from qasr.server.lifecycle import DrainGate
from qasr.server.metrics import Metrics, ObserveRequests
from qasr.server.native_stream import router as native_stream_router
from qasr.server.realtime import router as realtime_router
from qasr.server.routes import router
from qasr.server.state import ServerState
from qasr.server.upload import UploadLimit
from qasr.transcribe.warm_up import warm_up

if TYPE_CHECKING:
    from qasr.transcribe.asr import ASR

log = logging.getLogger("qasr.server")
CUT_GRACE_S = 2.0  # after a cut: time for the error answers to go out
ENGINE_CLOSE_S = 10.0  # after a drain the engine holds only what a cut left


def create_app(config: ServerConfig, load: Callable[[], ASR]) -> FastAPI:
    """``load`` builds the ASR (called once, in a worker thread, after start-up)."""
    metrics = Metrics()
    state = ServerState(config, metrics)
    metrics.watch_engines(lambda: {role: engine.stats() for role, engine in state.engines().items()},
                          state.engine_restarts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, load))
        watcher = asyncio.create_task(_stop_when_drained(state))
        try:
            yield
        finally:
            loader.cancel()
            watcher.cancel()
            if state.asr is not None:  # stop the engines' threads; after a cut drain, drop what they hold
                finish = not state.drain_cut.is_set()
                core = state.asr._core
                await asyncio.to_thread(core.engine.close, finish, ENGINE_CLOSE_S)
                if core.aligner is not None:
                    await asyncio.to_thread(core.aligner.engine.close, finish, ENGINE_CLOSE_S)
            state.close_pools()

    # no /docs or /openapi.json: the transcription route reads its form by hand
    app = FastAPI(title="qasr", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.qasr = state
    app.state.page = _page()
    install_handlers(app)
    app.include_router(router)
    app.include_router(realtime_router)  # WebSocket /v1/realtime
    app.include_router(native_stream_router)  # WebSocket /v1/stream
    # added innermost first: requests pass ObserveRequests, DrainGate, ApiKeyAuth, UploadLimit, then the routes
    app.add_middleware(UploadLimit, max_bytes=config.max_upload_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    app.add_middleware(DrainGate, state=state)
    app.add_middleware(ObserveRequests, metrics=metrics)
    return app


async def _load(state: ServerState, load: Callable[[], ASR]) -> None:
    started = time.perf_counter()
    try:
        asr = await asyncio.to_thread(load)
        # an engine process warms itself up before it says ready (each time it starts): an in-process one here
        if state.config.warmup and not isinstance(asr._core.engine, RemoteEngine):
            await asyncio.to_thread(warm_up, asr)
    except Exception as exc:  # noqa: BLE001 - reported by /health and every request
        log.exception("the model failed to load")
        state.load_error = f"{type(exc).__name__}: {exc}"
        return
    state.asr = asr
    state.ready = True
    log.info("model %s ready in %.1f s", state.config.model, time.perf_counter() - started)


async def _stop_when_drained(state: ServerState) -> None:
    """Once a drain starts, stop the server when nothing is in flight, or at the deadline: then what is
    left is cut (``state.drain_cut``) and given ``CUT_GRACE_S`` to say so."""
    while not state.draining:
        await asyncio.sleep(0.05)
    while state.in_flight and not state.drain_overdue():
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("drain timeout (%g s): ending %d requests and sessions unfinished",
                    state.config.drain_timeout_s, state.in_flight)
        state.drain_cut.set()
        cut_at = time.monotonic()
        while state.in_flight and time.monotonic() - cut_at < CUT_GRACE_S:
            await asyncio.sleep(0.05)
    if state.on_drained is not None:
        state.on_drained()


def _page() -> str:
    """index.html with app.js inlined, so the page is one open route."""
    static = resources.files("qasr.server") / "static"
    html = (static / "index.html").read_text(encoding="utf-8")
    script = (static / "app.js").read_text(encoding="utf-8")
    return html.replace('<script src="app.js"></script>', f"<script>\n{script}</script>")
