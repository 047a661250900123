"""WebSocket ``/v1/realtime``: OpenAI's Realtime transcription events, plus ``...transcription.partial``
and ``input_audio_buffer.progress`` of ours, or vLLM's dialect, told by the client's first event
(docs/streaming.md, "Two dialects").
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Literal

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from qasr.audio.io import SAMPLE_RATE
from qasr.server.live_runner import LiveRunner, Op
from qasr.server.live_ws import (
    CLOSE_BAD_REQUEST,
    CLOSE_GOING_AWAY,
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
from qasr.streaming.config import SERVED_RANGES
from qasr.transcribe.text import is_unspaced

router = APIRouter()
PARTIAL = "conversation.item.input_audio_transcription.partial"
PROGRESS = "input_audio_buffer.progress"
VLLM_RATE = 16000  # vLLM's realtime audio is PCM16 at 16 kHz
Dialect = Literal["openai", "vllm"]
SERVER_VAD = {"type": "server_vad", "threshold": LiveConfig.vad_threshold,
              "prefix_padding_ms": LiveConfig.prefix_padding_ms, "silence_duration_ms": LiveConfig.silence_ms}


@dataclass(frozen=True)
class RealtimeSettings:
    rate: int = 24000  # OpenAI's pcm16 is 24 kHz
    language: str | None = None
    prompt: str = ""
    turn_detection: dict | None = field(default_factory=lambda: dict(SERVER_VAD))

    def describe(self, beta: bool) -> dict:
        transcription = {"model": "qwen3-asr", "language": self.language, "prompt": self.prompt}
        if beta:
            return {"object": "realtime.transcription_session", "input_audio_format": "pcm16",
                    "input_audio_transcription": transcription, "turn_detection": self.turn_detection}
        return {"type": "transcription", "object": "realtime.transcription_session",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.rate},
                                    "transcription": transcription, "turn_detection": self.turn_detection}}}


class VllmTranscript:
    """One ``transcription.done``'s text: the turns' texts joined as segments are (a space unless a script
    written without spaces meets it), and equal to the deltas sent for it, joined."""

    def __init__(self) -> None:
        self.ended = ""  # the ended turns, as sent
        self.open = ""  # what was sent for the open turn, its separator included
        self._lead: str | None = None  # the open turn's separator, once it has text

    def update(self, stable: str) -> str:
        """The open turn's stable text is now ``stable``: what to send."""
        text = stable.lstrip()
        if not text:
            return ""
        if self._lead is None:
            self._lead = " " if self.ended and not (is_unspaced(self.ended[-1]) or is_unspaced(text[0])) else ""
        full = self._lead + text
        if not full.startswith(self.open):  # sent text is never taken back
            return ""
        delta, self.open = full[len(self.open):], full
        return delta

    def end_turn(self, text: str) -> str:
        delta = self.update(text)
        self.ended, self.open, self._lead = self.ended + self.open, "", None
        return delta

    def take(self) -> str:
        text = self.ended + self.open
        self.ended, self.open, self._lead = "", "", None
        return text


class RequestError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.qasr
    offered = offered_subprotocols(ws)
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    channel = Channel(ws, state)
    why = refusal(ws, state)
    if why is None and ws.query_params.get("intent", "transcription") != "transcription":
        await channel.send(_error("unsupported_intent", "this server only transcribes: connect with "
                                  "?intent=transcription"))
        await channel.close(CLOSE_BAD_REQUEST, "unsupported intent")
        return
    if why is not None:
        await channel.send(_error(why.code, why.message))
        await channel.close(why.close_code, why.message)
        return
    await hold_session(state, channel, RealtimeConnection(channel, state).run)


class RealtimeConnection:
    def __init__(self, channel: Channel, state: ServerState) -> None:
        self.channel = channel
        self.state = state
        self.settings = RealtimeSettings()
        self._ids = itertools.count()
        self._session_id = "sess_" + uuid.uuid4().hex[:20]
        self._items = "item_" + uuid.uuid4().hex[:12]
        self._previous_item: str | None = None
        self._turn_seconds: dict[int, float] = {}
        self._beta = False
        self.dialect: Dialect | None = None  # set by the first event; OpenAI's answers until then
        self._configured = False  # a session.update was accepted
        self._refused: str | None = None  # why audio is refused: an update was refused, none accepted since
        self._transcript = VllmTranscript()
        self._done_at = 0  # audio_samples at the last transcription.done
        self.runner = self._new_runner()

    async def run(self) -> None:
        try:
            await self._send("session.created", session=self._session(), id=self._session_id,
                             created=int(time.time()))
            await self._progress()  # the backlog, so a client can pace itself from its first append
            while not self.runner.failed:  # a failed session was reported and closed by _fail
                message = await self.channel.receive(lambda: self.runner.busy, lambda: self.runner.has_room())
                if message.get("text") is None:
                    await self._send_error("invalid_event", "send JSON text events; audio goes base64-encoded in "
                                           "input_audio_buffer.append")
                    continue
                await self._handle(message["text"])
        except WebSocketDisconnect:
            pass  # the client left: its session is freed below
        except Idle:
            await unless_gone(self._send_error("session_idle", f"no event for "
                                               f"{self.state.config.live_idle_timeout_s:g} s: the session is closed"))
            await self.channel.close(1000, "idle")
        except EngineLost as exc:
            if not self.runner.failed:
                await unless_gone(self._fail(exc))
        except Draining:  # the audio received still gets its transcript, by the deadline
            await unless_gone(self._send_error("shutting_down", await drain_session(self.runner, self.state)))
            await self.channel.close(CLOSE_GOING_AWAY, "server shutting down")
        finally:
            await end_session(self.runner)

    # --- client events
    async def _handle(self, text: str) -> None:
        try:
            event = json.loads(text)
            if not isinstance(event, dict):
                raise ValueError
        except ValueError:
            await self._send_error("invalid_json", "the event is not a JSON object")
            return
        kind = event.get("type")
        try:
            if self.dialect is None:
                await self._detect(event)
            if kind == "session.update" and self.dialect == "vllm":
                self._vllm_update(event)
            elif kind in ("session.update", "transcription_session.update"):
                await self._update(event, beta=kind == "transcription_session.update")
            elif kind == "input_audio_buffer.append":
                self._append(event)
            elif kind == "input_audio_buffer.commit":
                if self.dialect != "vllm" or event.get("final") is True:
                    self.runner.commit()  # vLLM's commit without final says "ready": a session always listens
            elif kind == "input_audio_buffer.clear":
                self.runner.clear()
            else:
                raise RequestError("unknown_event", f"unsupported event type {kind!r}", "type")
        except RequestError as exc:
            await self._send_error(exc.code, exc.message, exc.param, event.get("event_id"))

    async def _detect(self, event: dict) -> None:
        """vLLM's dialect: a first ``session.update`` with a top-level ``model`` and no ``session``, or a first
        ``input_audio_buffer.commit`` on a URL without ``intent`` (vLLM's "ready"; OpenAI's would be empty)."""
        kind = event.get("type")
        vllm = (kind == "session.update" and "session" not in event and "model" in event) or (
            kind == "input_audio_buffer.commit" and "intent" not in self.channel.ws.query_params)
        self.dialect = "vllm" if vllm else "openai"
        if vllm:  # before any audio: the session restarts at vLLM's rate
            self.settings = replace(self.settings, rate=VLLM_RATE)
            await self.runner.close()
            self.runner = self._new_runner()

    def _vllm_update(self, event: dict) -> None:
        """vLLM's ``session.update``: names the model (any name is served); answered only when refused."""
        model = event.get("model")
        if not isinstance(model, str) or not model or "session" in event:
            why = "session.update needs 'model', a model name, and no 'session' object"
            if not self._configured:
                self._refused = why
                why += "; audio is refused until a session.update is accepted"
            raise RequestError("invalid_event", why, "model")
        self._configured, self._refused = True, None

    def _append(self, event: dict) -> None:
        if self._refused is not None:
            raise RequestError("session_not_configured", f"the session has no audio settings: a session.update was "
                               f"refused ({self._refused}); send a valid one before audio", "audio")
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RequestError("invalid_audio", "input_audio_buffer.append needs 'audio': base64 PCM16", "audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError("invalid_audio", f"'audio' is not valid base64: {exc}", "audio") from exc
        self.runner.audio(pcm)  # never refused: a full backlog holds the next read back instead

    async def _update(self, event: dict, beta: bool) -> None:
        """Until an update is accepted, a refused one leaves the session unconfigured (audio refused until a
        valid update); so does one asking for an audio format, so audio is never read at a rate not chosen."""
        session = event.get("session")
        try:
            settings = self._updated(session, beta)
        except RequestError as exc:
            if not self._configured or _names_format(session, beta):
                self._refused = exc.message
                exc.message += "; the session stays unconfigured: audio is refused until a session.update is accepted"
            raise
        self._configured, self._refused = True, None
        if settings != self.settings:
            self.settings = settings
            await self.runner.close()
            self.runner = self._new_runner()
        self._beta = self._beta or beta
        await self._send("transcription_session.updated" if beta else "session.updated", session=self._session())

    def _updated(self, session: object, beta: bool) -> RealtimeSettings:
        if not isinstance(session, dict):
            raise RequestError("invalid_session", "the update needs a 'session' object (OpenAI's dialect; vLLM's "
                               "names a top-level 'model' in the session's first event)", "session")
        settings = _apply(self.settings, session, beta, self.state)
        runner = self.runner
        if settings != self.settings and (runner.audio_samples or runner.backlog or runner.session.in_turn):
            raise RequestError("session_busy", "audio settings cannot change after audio was sent; "
                               "send the update first, or open a new session", "session")
        return settings

    # --- server events
    def _new_runner(self) -> LiveRunner:
        s, cfg = self.settings, self.state.config
        asr = self.state.asr
        assert asr is not None
        vad = s.turn_detection or {}
        stream = StreamConfig(chunk_size_sec=cfg.live_chunk_s, language=s.language, context=s.prompt,
                              engine_timeout_s=cfg.engine_timeout_s)
        live = LiveConfig(stream=stream, turn_detection=s.turn_detection is not None,
                          vad_threshold=float(vad.get("threshold", LiveConfig.vad_threshold)),
                          prefix_padding_ms=int(vad.get("prefix_padding_ms", LiveConfig.prefix_padding_ms)),
                          silence_ms=int(vad.get("silence_duration_ms", LiveConfig.silence_ms)),
                          end_on_chunk=cfg.live_end_on_chunk)
        return LiveRunner(asr.live(live), PcmIngest("pcm16", s.rate),
                          self._emit, self._fail, cfg.live_max_backlog_s, self.state.live_pool, self._progress)

    async def _progress(self) -> None:
        if self.dialect == "vllm":
            return
        r = self.runner
        await self._send(PROGRESS, audio_processed_ms=round(r.audio_samples * 1000 / SAMPLE_RATE),
                         backlog_ms=round(r.backlog * 1000 / SAMPLE_RATE), max_backlog_ms=round(r.max_backlog_s * 1000))

    async def _emit(self, op: Op, events: list[LiveEvent]) -> None:
        if self.dialect == "vllm":
            await self._emit_vllm(op, events)
            return
        if op == "commit" and not any(isinstance(e, TurnFinal) for e in events):
            await self._send_error("input_audio_buffer_commit_empty", "the buffer holds no audio to commit")
        if op == "clear":
            await self._send("input_audio_buffer.cleared")
        for e in events:
            item = self._item(e.turn)
            if isinstance(e, SpeechStarted):
                await self._send("input_audio_buffer.speech_started", audio_start_ms=round(e.at * 1000),
                                 item_id=item)
            elif isinstance(e, SpeechStopped):
                await self._send("input_audio_buffer.speech_stopped", audio_end_ms=round(e.at * 1000), item_id=item)
            elif isinstance(e, TurnUpdate):
                if e.delta:
                    await self._delta(item, e.delta)
                await self._send(PARTIAL, item_id=item, content_index=0, stable=e.update.stable_text,
                                 unstable=e.update.unstable_text, language=e.update.language)
            elif isinstance(e, TurnFinal):
                await self._final(item, e)

    async def _emit_vllm(self, op: Op, events: list[LiveEvent]) -> None:
        """Deltas as turns grow; ``transcription.done`` at a final commit, with every turn since the last."""
        for e in events:
            delta = ""
            if isinstance(e, TurnUpdate):
                delta = self._transcript.update(e.update.stable_text)
            elif isinstance(e, TurnFinal):
                delta = self._transcript.end_turn(e.text)
                self.state.metrics.live_audio_seconds.inc(e.end - e.start)
            if delta:
                await self._send("transcription.delta", delta=delta)
        if op == "commit":
            seconds = (self.runner.audio_samples - self._done_at) / SAMPLE_RATE
            self._done_at = self.runner.audio_samples
            await self._send("transcription.done", text=self._transcript.take(),
                             usage={"type": "duration", "seconds": round(seconds, 3)})

    async def _delta(self, item: str, delta: str) -> None:
        await self._send("conversation.item.input_audio_transcription.delta", item_id=item, content_index=0,
                         delta=delta)

    async def _final(self, item: str, e: TurnFinal) -> None:
        if e.delta:
            await self._delta(item, e.delta)
        await self._send("input_audio_buffer.committed", item_id=item, previous_item_id=self._previous_item)
        await self._send("conversation.item.added", previous_item_id=self._previous_item,
                         item={"id": item, "object": "realtime.item", "type": "message", "status": "completed",
                               "role": "user", "content": [{"type": "input_audio", "transcript": None}]})
        await self._send("conversation.item.input_audio_transcription.completed", item_id=item, content_index=0,
                         transcript=e.text, language=e.language, start=round(e.start, 3), end=round(e.end, 3),
                         usage={"type": "duration", "seconds": round(e.end - e.start, 3)})
        self.state.metrics.live_audio_seconds.inc(e.end - e.start)
        self._previous_item = item

    async def _fail(self, exc: Exception) -> None:
        await self._send_error("server_error", failure_message(exc))
        await self.channel.close(1011, "transcription failed")

    def _item(self, turn: int) -> str:
        return f"{self._items}_{turn:05d}"

    def _session(self) -> dict:
        return {"id": self._session_id, **self.settings.describe(self._beta)}

    async def _send(self, kind: str, **fields: object) -> None:
        await self.channel.send({"type": kind, "event_id": f"event_{next(self._ids)}", **fields})

    async def _send_error(self, code: str, message: str, param: str | None = None,
                          client_event: str | None = None) -> None:
        if self.dialect == "vllm":
            await self.channel.send({"type": "error", "error": message, "code": code})
            return
        await self.channel.send({"event_id": f"event_{next(self._ids)}", **_error(code, message, param, client_event)})


def _error(code: str, message: str, param: str | None = None, client_event: str | None = None) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "code": code, "message": message,
                                       "param": param, "event_id": client_event}}


def _names_format(session: object, beta: bool) -> bool:
    if not isinstance(session, dict):
        return False
    if beta:
        return "input_audio_format" in session
    audio = session.get("audio")
    return isinstance(audio, dict) and isinstance(audio.get("input"), dict) and "format" in audio["input"]


def _apply(settings: RealtimeSettings, session: dict, beta: bool, state: ServerState) -> RealtimeSettings:
    """The settings after a ``session.update`` (GA shape) or ``transcription_session.update`` (beta)."""
    if beta:
        fmt = session.get("input_audio_format")
        if fmt is not None and fmt != "pcm16":
            raise RequestError("unsupported_format", f"input_audio_format {fmt!r} is not supported; send pcm16",
                               "session.input_audio_format")
        transcription = session.get("input_audio_transcription")
        detection_holder = session
    else:
        audio_in = (session.get("audio") or {}).get("input") or {}
        fmt = audio_in.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm":
                raise RequestError("unsupported_format", "only audio/pcm (little-endian 16-bit) is supported",
                                   "session.audio.input.format")
            rate = fmt.get("rate", settings.rate)
            if not isinstance(rate, int) or not 8000 <= rate <= 48000:
                raise RequestError("unsupported_format", f"rate must be an integer 8000-48000 Hz, got {rate!r}",
                                   "session.audio.input.format.rate")
            settings = replace(settings, rate=rate)
        transcription = audio_in.get("transcription")
        detection_holder = audio_in
    if transcription is not None:
        if not isinstance(transcription, dict):
            raise RequestError("invalid_session", "transcription settings must be an object", "session")
        asr = state.asr
        assert asr is not None
        try:
            language = asr._core.canonical_language(transcription.get("language") or None)
        except ValueError as exc:
            raise RequestError("unsupported_language", str(exc), "language") from exc
        settings = replace(settings, language=language, prompt=str(transcription.get("prompt") or ""))
    if "turn_detection" in detection_holder:
        settings = replace(settings, turn_detection=_turn_detection(detection_holder["turn_detection"]))
    return settings


def _turn_detection(value: object) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type", "server_vad") not in ("server_vad", "semantic_vad"):
        raise RequestError("invalid_turn_detection", "turn_detection must be null or {'type': 'server_vad', ...}",
                           "turn_detection")
    merged = {**SERVER_VAD, **{k: v for k, v in value.items() if k in SERVER_VAD and v is not None}}
    merged["type"] = "server_vad"  # semantic_vad is served by the same voice detector
    threshold = merged["threshold"]
    if not isinstance(threshold, int | float) or not 0 < threshold < 1:
        raise RequestError("invalid_turn_detection", "turn_detection.threshold must be in (0, 1)", "turn_detection")
    for key, setting in (("prefix_padding_ms", "prefix_padding_ms"), ("silence_duration_ms", "silence_ms")):
        low, high = SERVED_RANGES[setting]
        if not isinstance(merged[key], int) or not low <= merged[key] <= high:
            raise RequestError("invalid_turn_detection", f"turn_detection.{key} must be an integer from {low:g} to "
                               f"{high:g}", "turn_detection")
    return merged

