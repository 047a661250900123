"""The HTTP routes: transcriptions (plain and streamed), translations (refused), models, health, metrics,
the web page and its icon."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect

from qasr.audio.io import AudioError
from qasr.audio.probe import probe_duration
from qasr.server import sse
from qasr.server.errors import ApiError, error_body
from qasr.server.limits import Ticket, UploadAdmission
from qasr.server.params import parse_params
from qasr.server.responses import render_response, token_usage
from qasr.server.state import ServerState
from qasr.server.upload import UploadTooLarge, upload_audio
from qasr.server.work import EngineRun, Finished, Upload, prepare_upload

router = APIRouter()
T = TypeVar("T")
CLIENT_GONE = 499  # nginx's "client closed request", for metrics
ICON_PATH = "/favicon.ico"
ICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
            '<rect width="32" height="32" rx="7" fill="#1f4e79"/>'
            '<path d="M6 20v-8M11 23V9M16 26V6M21 23V9M26 20v-8" stroke="#fff" stroke-width="2.6" '
            'stroke-linecap="round"/></svg>')


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _state(request: Request) -> ServerState:
    return request.app.state.qasr


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    state = _state(request)
    core = state.require_asr()._core
    try:
        form = await _read_form(request)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    try:
        params = parse_params(form, core)
        source = upload_audio(params.file, params.filename)
        try:  # off the event loop: FFmpeg may read a few MB
            duration = await state.in_decode_pool(lambda: probe_duration(source))
        except AudioError as exc:
            raise ApiError(400, str(exc), param="file", code="invalid_audio") from exc
        admission = UploadAdmission(state.budget, duration, params.filename)  # the 429, before any decoding
        state.metrics.queued_audio.set(state.budget.queued_s)
        try:
            upload = await _decode(request, state, admission, lambda: prepare_upload(
                core, replace(source, watch=admission.watch), params.options))
        except BaseException:
            _release(state, admission.ticket, None)
            raise
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    finally:
        await form.close()
    ticket = admission.ticket
    ticket.resize(upload.duration)  # the decoded audio, no longer the header's figure
    state.metrics.queued_audio.set(state.budget.queued_s)
    try:
        run = EngineRun(core, upload, stream=params.stream, words=params.words, handoff=state.token_handoff(),
                        trouble=state.engine_trouble)
    except BaseException:
        _release(state, ticket, None)
        raise
    if params.stream:
        return StreamingResponse(_events(state, run, ticket, params.response_format == "verbose_json"),
                                 media_type=sse.MEDIA_TYPE,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(_abandon, state, run, ticket))
    done = None
    try:
        done = await _unless_disconnected(request, run.finish())
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    finally:
        _release(state, ticket, done)
    return render_response(done, params.response_format, params.words, params.segments)


async def _decode(request: Request, state: ServerState, admission: UploadAdmission,
                  work: Callable[[], Upload]) -> Upload:
    """The upload's decoding on the decode pool, stopped if the client leaves. A stop by the admission
    answers its refusal (413, 429); another decoding error is a 400."""
    try:
        return await _unless_disconnected(request, state.in_decode_pool(work), stop=admission.leave)
    except AudioError as exc:
        if admission.refusal is not None:
            raise admission.refusal from exc
        raise ApiError(400, str(exc), param="file", code="invalid_audio") from exc


async def _events(state: ServerState, run: EngineRun, ticket: Ticket, segments: bool) -> AsyncIterator[bytes]:
    """The SSE body; a client that leaves cancels it, and ``finally`` cancels the engine requests. A failure
    (a stalled engine's included) ends it with an error event."""
    done = None
    try:
        try:
            async for item in run.deltas(segments=segments):
                if isinstance(item, str):
                    yield sse.delta_event(item)
                else:
                    yield sse.segment_event(*item)
            done = await run.finish()
        except ApiError as exc:
            yield sse.error_event(error_body(exc.status, exc.message, exc.param, exc.code))
            return
        yield sse.done_event(done.transcription.text, token_usage(done))
    finally:
        run.cancel()
        _release(state, ticket, done)


async def _abandon(state: ServerState, run: EngineRun, ticket: Ticket) -> None:
    """After a stream's response, however it ended."""
    run.cancel()
    _release(state, ticket, None)


def _release(state: ServerState, ticket: Ticket, done: Finished | None) -> None:
    if done is not None:
        state.metrics.audio_seconds.inc(done.transcription.duration)
        if done.ttft_s is not None:
            state.metrics.ttft.observe(done.ttft_s)
    ticket.release(transcribed=done is not None)
    state.metrics.queued_audio.set(state.budget.queued_s)


async def _read_form(request: Request) -> FormData:
    ctype = request.headers.get("content-type", "").lower()
    if not ctype.startswith("multipart/form-data"):
        raise ApiError(400, "send the audio as multipart/form-data with the file in the field 'file'",
                       param="file")
    try:
        return await request.form(max_files=4, max_fields=64)
    except UploadTooLarge as exc:
        raise ApiError(413, str(exc), param="file", code="file_too_large") from exc
    except (HTTPException, MultiPartException) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", str(exc))
        raise ApiError(400, f"malformed multipart body: {detail}") from exc
    except ClientDisconnect as exc:
        raise ClientGone() from exc


async def _unless_disconnected(request: Request, work: Awaitable[T], stop: Callable[[], None] | None = None) -> T:
    """Await ``work`` unless the client disconnects first (ClientGone) or this request is cancelled.
    Either way ``work`` is stopped and waited for first: cancelled, or by ``stop()`` for work on a thread."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = watch.done()
        watch.cancel()
        if not task.done():
            (stop or task.cancel)()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: a stopped work's error is no one's to report
            if left:
                raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # the body is consumed: the next message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/v1/audio/translations")
async def translations() -> Response:
    raise ApiError(400, "translation is not available: Qwen3-ASR transcribes speech in the language spoken and "
                        "does not translate; use /v1/audio/transcriptions", code="unsupported_endpoint")


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"object": "list", "data": [_model(state, name) for name in state.config.served_names]})


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str) -> JSONResponse:
    state = _state(request)
    if name not in state.config.served_names:
        raise ApiError(404, f"model {name!r} is not served here; served: {', '.join(state.config.served_names)}",
                       param="model", code="model_not_found")
    return JSONResponse(_model(state, name))


def _model(state: ServerState, name: str) -> dict:
    d = {"id": name, "object": "model", "created": state.started, "owned_by": "qasr"}
    if state.asr is not None:  # beyond OpenAI's: the languages, word timing, and how the model runs
        d["languages"] = list(state.asr.supported_languages)
        aligner = state.asr._core.aligner
        d["word_timestamps"] = aligner is not None
        if aligner is not None:
            d["word_timestamp_languages"] = list(aligner.supported_languages)
        engine = state.asr._core.engine
        d["quantize"] = engine.config.quantize or "none"
        d["kv_cache_dtype"] = engine.config.kv_cache_dtype
        d["kernels"] = engine.description
    return d


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    if not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    trouble = state.engine_trouble()
    if trouble is not None:
        status, why = trouble
        return JSONResponse({"status": status, "error": why}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.config.model})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.queued_audio.set(state.budget.queued_s)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(request.app.state.page, headers={"Cache-Control": "no-cache"})


@router.get(ICON_PATH, include_in_schema=False)
async def favicon() -> Response:
    """Open like the page: browsers fetch it unasked and without the key; an SVG keeps the package free of binaries."""
    return Response(ICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400"})
