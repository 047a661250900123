"""WebSocket ``/v1/stream``: qasr's own live protocol, for raw PCM in binary messages.

An optional first ``{"type": "start", ...settings}`` is answered by ``ready``; then PCM and ``commit``,
``clear``, ``end``. Events and close codes: docs/streaming.md.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from qasr.audio.io import SAMPLE_RATE
from qasr.server.live_runner import LiveRunner, Op
from qasr.server.live_ws import (
    CLOSE_BAD_REQUEST,
    CLOSE_GOING_AWAY,
    DRAIN_CUT,
    Channel,
    Draining,
    EngineLost,
    Idle,
    drain_session,
    end_session,
    failure_message,
    hold_session,
    offered_subprotocols,
    refusal,
    unless_gone,
)
from qasr.server.state import ServerState
from qasr.streaming import (
    LiveConfig,
    LiveEvent,
    PcmIngest,
    SpeechStarted,
    SpeechStopped,
    StreamConfig,
    TurnFinal,
    TurnUpdate,
)
from qasr.streaming.config import START_SETTINGS, from_start

router = APIRouter()


class StartError(ValueError):
    def __init__(self, message: str, code: str = "invalid_start") -> None:
        super().__init__(message)
        self.code = code


@router.websocket("/v1/stream")
async def stream(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.qasr
    # a browser sending its key as a subprotocol needs one of its offered subprotocols chosen
    await ws.accept(subprotocol="qasr-stream" if "qasr-stream" in offered_subprotocols(ws) else None)
    channel = Channel(ws, state)
    why = refusal(ws, state)
    if why is not None:
        await unless_gone(channel.send({"type": "error", "code": why.code, "message": why.message}))
        await channel.close(why.close_code, why.message)
        return
    await hold_session(state, channel, lambda: _serve(channel, state))


async def _serve(channel: Channel, state: ServerState) -> None:
    session_id = "stream_" + uuid.uuid4().hex[:16]
    runner: LiveRunner | None = None

    async def emit(op: Op, events: list[LiveEvent]) -> None:
        if op == "commit" and not any(isinstance(e, TurnFinal) for e in events):
            await channel.send({"type": "error", "code": "nothing_to_commit", "message": "no audio to commit"})
        for e in events:
            await channel.send(_message(e))
            if isinstance(e, TurnFinal):
                state.metrics.live_audio_seconds.inc(e.end - e.start)

    async def fail(exc: Exception) -> None:
        await channel.send({"type": "error", "code": "server_error", "message": failure_message(exc)})
        await channel.close(1011, "transcription failed")

    try:
        first = await channel.receive()
        settings: dict = {}
        try:
            if first.get("text") is not None:
                settings = _settings(first["text"])
            live, ingest = _session_config(settings, state)
        except ValueError as exc:  # StartError, or a setting a config refused: a bad request (4400)
            code = exc.code if isinstance(exc, StartError) else "invalid_start"
            await channel.send({"type": "error", "code": code, "message": str(exc)})
            await channel.close(CLOSE_BAD_REQUEST, "invalid start message")
            return
        asr = state.asr
        assert asr is not None

        async def progress() -> None:
            assert runner is not None
            await channel.send({"type": "progress", "audio_seconds": round(runner.audio_samples / SAMPLE_RATE, 3),
                                "backlog_seconds": round(runner.backlog / SAMPLE_RATE, 3),
                                "max_backlog_seconds": runner.max_backlog_s})

        runner = LiveRunner(asr.live(live), ingest, emit, fail,
                            state.config.live_max_backlog_s, state.live_pool, progress)
        config = {**_describe(live, ingest), "max_backlog_seconds": state.config.live_max_backlog_s}
        await channel.send({"type": "ready", "session": session_id, "config": config})
        message = first if first.get("bytes") is not None else None
        while not runner.failed:
            if message is None:
                message = await channel.receive(lambda: runner.busy, runner.has_room)
            if await _handle(message, runner, channel):
                if not await runner.finish_by(state.drain_cut):  # a drain's deadline came first
                    await channel.send({"type": "error", "code": "shutting_down", "message": DRAIN_CUT})
                    await channel.close(CLOSE_GOING_AWAY, "server shutting down")
                    return
                if not runner.failed:
                    await channel.send({"type": "done", "session": session_id, "turns": runner.session.turns,
                                        "audio_seconds": round(runner.audio_samples / SAMPLE_RATE, 3)})
                    await channel.close(1000, "done")
                return
            message = None
    except WebSocketDisconnect:
        pass  # the client left: its session is freed below
    except Idle:
        await unless_gone(channel.send({"type": "error", "code": "session_idle", "message": "nothing received for "
                                        f"{state.config.live_idle_timeout_s:g} s: closed"}))
        await channel.close(1000, "idle")
    except EngineLost as exc:
        if runner is None or not runner.failed:
            await unless_gone(fail(exc))
    except Draining:  # the audio received gets its transcript (within the drain's deadline), then 1001
        why = await drain_session(runner, state)
        await unless_gone(channel.send({"type": "error", "code": "shutting_down", "message": why}))
        await channel.close(CLOSE_GOING_AWAY, "server shutting down")
    finally:
        await end_session(runner)


async def _handle(message: dict, runner: LiveRunner, channel: Channel) -> bool:
    """Apply one client message; True at the end of the stream."""
    if message.get("bytes") is not None:
        try:
            runner.audio(message["bytes"])
        except ValueError as exc:
            await channel.send({"type": "error", "code": "invalid_audio", "message": str(exc)})
        return False
    try:
        kind = json.loads(message.get("text") or "").get("type")
    except (ValueError, AttributeError):
        kind = None
    if kind == "end":
        return True
    if kind == "commit":
        runner.commit()
    elif kind == "clear":
        runner.clear()
    else:
        await channel.send({"type": "error", "code": "unknown_message",
                            "message": "text messages are {\"type\": \"commit\" | \"clear\" | \"end\"}; audio "
                                       "goes in binary messages"})
    return False


def _settings(text: str) -> dict:
    try:
        settings = json.loads(text)
    except ValueError as exc:
        raise StartError(f"the start message is not JSON: {exc}") from exc
    if not isinstance(settings, dict) or settings.get("type", "start") != "start":
        raise StartError("the first text message must be {\"type\": \"start\", ...settings}")
    return settings


def _session_config(s: dict, state: ServerState) -> tuple[LiveConfig, PcmIngest]:
    known = {"type", "sample_rate", "format"} | set(START_SETTINGS)
    unknown = sorted(set(s) - known)
    if unknown:
        raise StartError(f"unknown settings {unknown}; known: {sorted(known - {'type'})}")
    asr = state.asr
    assert asr is not None
    try:
        language = asr._core.canonical_language(s.get("language") or None)
    except ValueError as exc:
        raise StartError(str(exc), "unsupported_language") from exc
    # the server's defaults, which the start may change
    base = LiveConfig(stream=StreamConfig(chunk_size_sec=state.config.live_chunk_s,
                                          engine_timeout_s=state.config.engine_timeout_s),
                      end_on_chunk=state.config.live_end_on_chunk)
    settings = {k: v for k, v in s.items() if k in START_SETTINGS}
    live = from_start({**settings, "language": language}, base)
    ingest = PcmIngest(s.get("format", "pcm16"), int(s.get("sample_rate", SAMPLE_RATE)))
    return live, ingest


def _describe(live: LiveConfig, ingest: PcmIngest) -> dict:
    stream = {k: getattr(live.stream, k) for k in ("language", "context", "chunk_size_sec")}
    return {"sample_rate": ingest.sample_rate, "format": ingest.format, **stream,
            **{k: getattr(live, k) for k in START_SETTINGS if k not in stream}}


def _message(e: LiveEvent) -> dict:
    if isinstance(e, SpeechStarted):
        return {"type": "speech_started", "turn": e.turn, "at": round(e.at, 3)}
    if isinstance(e, SpeechStopped):
        return {"type": "speech_stopped", "turn": e.turn, "at": round(e.at, 3)}
    if isinstance(e, TurnUpdate):
        u = e.update
        return {"type": "partial", "turn": e.turn, "stable": u.stable_text, "unstable": u.unstable_text,
                "delta": e.delta, "language": u.language}
    return {"type": "final", "turn": e.turn, "text": e.text, "delta": e.delta, "language": e.language,
            "start": round(e.start, 3), "end": round(e.end, 3), "reason": e.reason}
