"""A live-transcription client for ``qasr serve`` over ``/v1/stream`` (native) or ``/v1/realtime`` (OpenAI's)."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from qasr.audio.io import SAMPLE_RATE, load_audio

Protocol = Literal["native", "openai"]
BYTES_PER_SAMPLE = 2  # 16 kHz pcm16
KEEPALIVE_S = 20.0
CONNECT_TIMEOUT_S = 10.0
WINDOW_SHARE = 0.5  # of the server's backlog that may be in flight, so it never fills


@dataclass(frozen=True)
class Partial:
    turn: int
    stable: str
    unstable: str


@dataclass(frozen=True)
class Final:
    turn: int
    text: str
    start: float | None
    end: float | None


@dataclass(frozen=True)
class ServerError:
    code: str
    message: str


StreamEvent = Partial | Final | ServerError


def file_chunks(path: str, chunk_ms: int) -> Iterator[bytes]:
    """A file as 16 kHz pcm16 chunks of ``chunk_ms``; not audio: fails before anything is sent."""
    pcm = (np.clip(load_audio(path), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    step = SAMPLE_RATE * chunk_ms // 1000 * BYTES_PER_SAMPLE
    return (pcm[i:i + step] for i in range(0, len(pcm), step))


class Capture:
    """16 kHz pcm16 chunks captured by ffmpeg (``-f input_format -i device``) until ``stop()``; a Ctrl-C
    reaches only qasr."""

    def __init__(self, input_format: str, device: str, chunk_ms: int) -> None:
        self.source = f"{input_format}:{device}"
        self._step = SAMPLE_RATE * chunk_ms // 1000 * BYTES_PER_SAMPLE
        cmd = ["ffmpeg", "-nostdin", "-loglevel", "error", "-f", input_format, "-i", device, "-ac", "1",
               "-ar", str(SAMPLE_RATE), "-f", "s16le", "-"]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True)
        except FileNotFoundError as exc:
            raise RuntimeError("capturing audio needs ffmpeg on PATH") from exc
        self.stopped = False

    def stop(self) -> None:
        """End the capture after what ffmpeg already gave (safe in a signal handler)."""
        self.stopped = True
        if self._proc.poll() is None:
            self._proc.terminate()

    def __iter__(self) -> Iterator[bytes]:
        proc = self._proc
        assert proc.stdout is not None and proc.stderr is not None
        try:
            while chunk := proc.stdout.read(self._step):
                yield chunk
            if proc.wait() != 0 and not self.stopped:
                raise RuntimeError(f"ffmpeg could not capture from {self.source}: "
                                   f"{proc.stderr.read().decode(errors='replace').strip()}")
        finally:
            self.stop()
            proc.wait()


def websocket_url(server: str, protocol: Protocol) -> str:
    parts = urlsplit(server if "://" in server else f"http://{server}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"--server must be an http(s):// or ws(s):// URL, got {server!r}")
    path = "/v1/realtime" if protocol == "openai" else "/v1/stream"
    query = "intent=transcription" if protocol == "openai" else ""
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, query, ""))


def stream(chunks: Iterable[bytes], server: str, protocol: Protocol = "native", language: str | None = None,
           turn_detection: bool = True, speed: float = 1.0, api_key: str | None = None,
           keepalive_s: float = KEEPALIVE_S, stop: threading.Event | None = None) -> Iterator[StreamEvent]:
    """Send ``chunks`` (16 kHz pcm16) at ``speed`` x real time (0: as fast as taken); yield the transcript events
    until the server answers the end. No overall timeout, only pings; ``stop`` ends the input early."""
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with connect(websocket_url(server, protocol), additional_headers=headers, open_timeout=CONNECT_TIMEOUT_S,
                 ping_interval=keepalive_s, ping_timeout=keepalive_s, close_timeout=keepalive_s, max_size=None) as ws:
        wire = _OpenAIWire(ws, language, turn_detection) if protocol == "openai" else _NativeWire(
            ws, language, turn_detection)
        wire.start()
        sender_error: list[BaseException] = []
        sender = threading.Thread(target=_send_all, args=(wire, chunks, speed, stop or threading.Event(),
                                                          sender_error), daemon=True)
        sender.start()
        try:
            while True:
                message = json.loads(ws.recv())
                yield from wire.events(message)
                if wire.done:
                    break
        finally:
            wire.halt()
            sender.join(timeout=5)
        if sender_error:
            raise sender_error[0]


def _send_all(wire: _Wire, chunks: Iterable[bytes], speed: float, stop: threading.Event,
              error: list[BaseException]) -> None:
    started = time.monotonic()
    try:
        for chunk in chunks:
            if stop.is_set() or wire.stopped:
                break
            if speed > 0:
                ahead = started + wire.sent_s / speed - time.monotonic()
                if ahead > 0 and stop.wait(ahead):
                    break
            if not wire.wait_for_room(len(chunk) / (SAMPLE_RATE * BYTES_PER_SAMPLE)):
                return
            wire.audio(chunk)
        if not wire.stopped:
            wire.end()
    except BaseException as exc:  # noqa: BLE001 - re-raised by stream()
        error.append(exc)


class _Wire:
    """Flow control: audio waits for the session to open and for room in ``window_s``."""

    def __init__(self) -> None:
        self.done = False
        self.stopped = False
        self.sent_s = 0.0
        self.processed_s = 0.0
        self.window_s: float | None = None
        self._open = False
        self._room = threading.Condition()

    def _fits(self, seconds: float) -> bool:
        in_flight = self.sent_s - self.processed_s
        return self.window_s is None or in_flight <= 0 or in_flight + seconds <= self.window_s

    def wait_for_room(self, seconds: float) -> bool:
        """Block until ``seconds`` more audio fits; False if the session stopped."""
        with self._room:
            self._room.wait_for(lambda: self.stopped or self._open and self._fits(seconds))
            if self.stopped:
                return False
            self.sent_s += seconds
            return True

    def opened(self) -> None:
        with self._room:
            self._open = True
            self._room.notify_all()

    def processed(self, seconds: float, max_backlog_s: float | None) -> None:
        with self._room:
            self.processed_s = max(self.processed_s, seconds)
            if max_backlog_s:
                self.window_s = max_backlog_s * WINDOW_SHARE
            self._room.notify_all()

    def halt(self) -> None:
        with self._room:
            self.stopped = True
            self._room.notify_all()


class _NativeWire(_Wire):
    FATAL = frozenset({"session_idle", "shutting_down", "server_error", "invalid_start", "unsupported_language",
                       "model_loading", "too_many_sessions", "invalid_api_key", "model_not_loaded"})

    def __init__(self, ws, language: str | None, turn_detection: bool) -> None:  # noqa: ANN001 - websockets type
        super().__init__()
        self.ws = ws
        self.settings = {"type": "start", "sample_rate": SAMPLE_RATE, "format": "pcm16", "language": language,
                         "turn_detection": turn_detection}

    def start(self) -> None:
        self.ws.send(json.dumps(self.settings))

    def audio(self, chunk: bytes) -> None:
        self.ws.send(chunk)

    def end(self) -> None:
        self.ws.send(json.dumps({"type": "end"}))

    def events(self, m: dict) -> Iterator[StreamEvent]:
        kind = m.get("type")
        if kind == "partial":
            yield Partial(m["turn"], m["stable"], m["unstable"])
        elif kind == "final":
            yield Final(m["turn"], m["text"], m["start"], m["end"])
        elif kind == "progress":
            self.processed(m["audio_seconds"], m.get("max_backlog_seconds"))
        elif kind == "ready":
            self.processed(0.0, (m.get("config") or {}).get("max_backlog_seconds"))
            self.opened()
        elif kind == "error":
            yield ServerError(m.get("code", ""), m.get("message", ""))
            self.done = m.get("code") in self.FATAL
        elif kind == "done":
            self.done = True


class _OpenAIWire(_Wire):
    """The stream ends with a commit and a clear: the server's ``cleared`` comes after all the audio."""

    FATAL = frozenset({"session_idle", "shutting_down", "server_error", "model_loading", "too_many_sessions",
                       "invalid_api_key", "model_not_loaded", "unsupported_intent", "unsupported_language",
                       "unsupported_format", "invalid_session", "invalid_turn_detection"})

    def __init__(self, ws, language: str | None, turn_detection: bool) -> None:  # noqa: ANN001
        super().__init__()
        self.ws = ws
        self.language = language
        self.turn_detection = turn_detection
        self._ended = False
        self._turns: dict[str, int] = {}

    def start(self) -> None:
        detection = {"type": "server_vad"} if self.turn_detection else None
        self.ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
            "transcription": {"model": "qwen3-asr", "language": self.language},
            "turn_detection": detection}}}}))

    def audio(self, chunk: bytes) -> None:
        self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))

    def end(self) -> None:
        self._ended = True
        self.ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        self.ws.send(json.dumps({"type": "input_audio_buffer.clear"}))

    def _turn(self, item: str) -> int:
        return self._turns.setdefault(item, len(self._turns))

    def events(self, m: dict) -> Iterator[StreamEvent]:
        kind = m.get("type", "")
        if kind == "conversation.item.input_audio_transcription.partial":
            yield Partial(self._turn(m["item_id"]), m["stable"], m["unstable"])
        elif kind == "conversation.item.input_audio_transcription.completed":
            yield Final(self._turn(m["item_id"]), m["transcript"], m.get("start"), m.get("end"))
        elif kind == "input_audio_buffer.progress":
            self.processed(m["audio_processed_ms"] / 1000, m.get("max_backlog_ms", 0) / 1000)
        elif kind in ("session.updated", "transcription_session.updated"):
            self.opened()
        elif kind == "input_audio_buffer.cleared":
            self.done = self._ended
        elif kind == "error":
            err = m.get("error") or {}
            code = err.get("code") or ""
            if code == "input_audio_buffer_commit_empty" and self._ended:
                return
            yield ServerError(code, err.get("message", ""))
            self.done = code in self.FATAL
