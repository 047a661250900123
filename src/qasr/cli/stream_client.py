"""A live-transcription client for ``qasr serve``: plays audio into a WebSocket in real time and yields the
server's transcript events, over qasr's native protocol (``/v1/stream``) or OpenAI's Realtime one
(``/v1/realtime``). ``qasr stream`` prints them; tests drive servers with it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from qasr.audio.io import SAMPLE_RATE, load_audio

Protocol = Literal["native", "openai"]
BYTES_PER_SAMPLE = 2  # the client always sends 16 kHz pcm16


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
    """A file decoded to 16 kHz pcm16, in chunks of ``chunk_ms``."""
    pcm = (np.clip(load_audio(path), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    step = SAMPLE_RATE * chunk_ms // 1000 * BYTES_PER_SAMPLE
    for i in range(0, len(pcm), step):
        yield pcm[i:i + step]


def capture_chunks(input_format: str, device: str, chunk_ms: int) -> Iterator[bytes]:
    """Audio captured by ffmpeg (``-f input_format -i device``: alsa/pulse on Linux, avfoundation on macOS,
    dshow on Windows, lavfi for generated test signals) as 16 kHz pcm16 chunks."""
    step = SAMPLE_RATE * chunk_ms // 1000 * BYTES_PER_SAMPLE
    cmd = ["ffmpeg", "-nostdin", "-loglevel", "error", "-f", input_format, "-i", device, "-ac", "1",
           "-ar", str(SAMPLE_RATE), "-f", "s16le", "-"]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError as exc:
        raise RuntimeError("capturing audio needs ffmpeg on PATH") from exc
    assert proc.stdout is not None and proc.stderr is not None
    try:
        while chunk := proc.stdout.read(step):
            yield chunk
        if proc.wait() != 0:
            raise RuntimeError(f"ffmpeg could not capture from {input_format}:{device}: "
                               f"{proc.stderr.read().decode(errors='replace').strip()}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def websocket_url(server: str, protocol: Protocol) -> str:
    parts = urlsplit(server if "://" in server else f"http://{server}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"--server must be an http(s):// or ws(s):// URL, got {server!r}")
    path = "/v1/realtime" if protocol == "openai" else "/v1/stream"
    query = "intent=transcription" if protocol == "openai" else ""
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, query, ""))


def stream(chunks: Iterator[bytes], server: str, protocol: Protocol = "native", language: str | None = None,
           turn_detection: bool = True, speed: float = 1.0, api_key: str | None = None,
           timeout: float = 60.0) -> Iterator[StreamEvent]:
    """Send ``chunks`` (16 kHz pcm16) paced at ``speed`` x real time (0: as fast as possible) and yield
    the transcript events until the server has answered the end of the stream."""
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with connect(websocket_url(server, protocol), additional_headers=headers, open_timeout=timeout,
                 max_size=None) as ws:
        wire = _OpenAIWire(ws, language, turn_detection) if protocol == "openai" else _NativeWire(
            ws, language, turn_detection)
        wire.start()
        sender_error: list[BaseException] = []
        sender = threading.Thread(target=_send_all, args=(wire, chunks, speed, sender_error), daemon=True)
        sender.start()
        try:
            while True:
                message = json.loads(ws.recv(timeout=timeout))
                yield from wire.events(message)
                if wire.done:
                    break
        finally:
            wire.stopped = True
            sender.join(timeout=5)
        if sender_error:
            raise sender_error[0]


def _send_all(wire: _NativeWire | _OpenAIWire, chunks: Iterator[bytes], speed: float,
              error: list[BaseException]) -> None:
    started = time.monotonic()
    sent = 0
    try:
        for chunk in chunks:
            if wire.stopped:
                return
            if speed > 0:  # real time: a chunk goes out once its audio would have been spoken
                ahead = started + sent / (SAMPLE_RATE * BYTES_PER_SAMPLE) / speed - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            wire.audio(chunk)
            sent += len(chunk)
        wire.end()
    except BaseException as exc:  # noqa: BLE001 - re-raised by stream() on the caller's thread
        error.append(exc)


class _NativeWire:
    def __init__(self, ws, language: str | None, turn_detection: bool) -> None:  # noqa: ANN001 - websockets type
        self.ws = ws
        self.settings = {"type": "start", "sample_rate": SAMPLE_RATE, "format": "pcm16", "language": language,
                         "turn_detection": turn_detection}
        self.done = False
        self.stopped = False

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
        elif kind == "error":
            yield ServerError(m.get("code", ""), m.get("message", ""))
            self.done = m.get("code") in ("session_idle", "shutting_down", "server_error", "invalid_start") or (
                m.get("code") in ("model_loading", "too_many_sessions", "invalid_api_key", "model_not_loaded"))
        elif kind == "done":
            self.done = True


class _OpenAIWire:
    """OpenAI's event names. The end of the stream is a commit followed by a clear: the server handles
    both in order after all the audio, so its ``cleared`` comes after every transcript of the stream."""

    FATAL = frozenset({"session_idle", "shutting_down", "server_error", "model_loading", "too_many_sessions",
                       "invalid_api_key", "model_not_loaded", "unsupported_intent"})

    def __init__(self, ws, language: str | None, turn_detection: bool) -> None:  # noqa: ANN001
        self.ws = ws
        self.language = language
        self.turn_detection = turn_detection
        self.done = False
        self.stopped = False
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
        elif kind == "input_audio_buffer.cleared":
            self.done = self._ended
        elif kind == "error":
            err = m.get("error") or {}
            code = err.get("code") or ""
            if code == "input_audio_buffer_commit_empty" and self._ended:
                return  # the closing commit found the last turn already ended by the VAD
            yield ServerError(code, err.get("message", ""))
            self.done = code in self.FATAL
