"""vLLM's ``/v1/realtime`` dialect on a real ``qasr serve MODEL`` (the model given positionally, as to
``vllm serve``): clients written from vLLM's documentation (PCM16 at 16 kHz, ``session.update`` with a
top-level ``model`` or none at all, ``input_audio_buffer.commit`` then ``final: true``) get
``transcription.delta`` / ``transcription.done`` with the text an OpenAI client gets for the same 16 kHz
bytes; a refused session configuration leaves the session unconfigured, in either dialect."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import numpy as np
import pytest
import websockets
from server_proc import DEMO_MODEL, ROOT, ServerProcess, free_port

from qasr.server.realtime import VllmTranscript
from qasr.testing.speech import speak
from qasr.transcribe.text import join_segment_texts

SENTENCES = ("remind me to buy milk tomorrow morning", "turn off the lights in the bedroom")
PROGRESS = "input_audio_buffer.progress"  # ours, sent before the client's first event tells the dialect
VLLM_TYPES = {"transcription.delta", "transcription.done", "error"}


class PositionalServer(ServerProcess):
    """``qasr serve MODEL``, as a vLLM user starts one."""

    def __init__(self, log_path) -> None:  # noqa: ANN001
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "qasr", "serve", str(DEMO_MODEL), "--device", "cpu",
                                      "--dtype", "float32", "--port", str(self.port)],
                                     cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.health_seen = []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PositionalServer(tmp_path_factory.mktemp("vllm_server") / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> list[bytes]:
    """Each sentence as PCM16 at 16 kHz, with half a second of silence either side."""
    from qasr.audio.io import load_audio

    d = tmp_path_factory.mktemp("vllm_audio")
    gap = np.zeros(8000, np.float32)
    out = []
    for k, text in enumerate(SENTENCES):
        wave = np.concatenate([gap, load_audio(speak(text, d / f"s{k}.wav")), gap])
        out.append((np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes())
    return out


def url(server: ServerProcess, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime" + query


def append(chunk: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})


async def until_done(ws) -> tuple[list[dict], str]:  # noqa: ANN001
    """The events up to ``transcription.done``, and the deltas joined."""
    events: list[dict] = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        events.append(event)
        assert event["type"] != "error", event
        if event["type"] == "transcription.done":
            return events, "".join(e["delta"] for e in events if e["type"] == "transcription.delta")


async def vllm_client(server: ServerProcess, utterances: list[bytes], update: bool = True) -> list[tuple]:
    """vLLM's documented client: session.created, session.update {model} (the older example sends none),
    a commit to start, 4 KiB appends, a final commit, deltas until done; again per utterance."""
    results = []
    async with websockets.connect(url(server)) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["id"] and isinstance(created["created"], int)
        if update:
            await ws.send(json.dumps({"type": "session.update", "model": "Qwen/Qwen3-ASR-0.6B"}))
        for audio in utterances:
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            for i in range(0, len(audio), 4096):
                await ws.send(append(audio[i:i + 4096]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            results.append(await until_done(ws))
    return results


async def openai_client(server: ServerProcess, audio: bytes, first_update: dict | None = None) -> list[dict]:
    """OpenAI's protocol at 16 kHz, the server's turn detection as vLLM's sessions have it: every event up to
    the ``cleared`` after a commit and a clear (``first_update``: a session.update sent first, to be refused)."""
    events: list[dict] = []
    async with websockets.connect(url(server, "?intent=transcription")) as ws:
        events.append(json.loads(await ws.recv()))

        async def send(event: dict) -> None:
            await ws.send(json.dumps(event))

        async def receive() -> dict:
            event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            while event["type"] == PROGRESS:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            events.append(event)
            return event

        if first_update is not None:
            await send(first_update)
            assert (await receive())["type"] == "error"
            await ws.send(append(audio[:3200]))
            assert (await receive())["error"]["code"] == "session_not_configured"
        await send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}}}}})
        assert (await receive())["type"] == "session.updated"
        for i in range(0, len(audio), 3200):
            await ws.send(append(audio[i:i + 3200]))
        await send({"type": "input_audio_buffer.commit"})
        await send({"type": "input_audio_buffer.clear"})
        while (await receive())["type"] != "input_audio_buffer.cleared":
            pass
    return events


def openai_text(events: list[dict]) -> str:
    return join_segment_texts(e["transcript"] for e in events if e["type"].endswith("transcription.completed"))


def words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalnum() or c.isspace()).split()


def test_a_vllm_client_gets_its_events_and_the_right_text(server, speech) -> None:
    results = asyncio.run(vllm_client(server, speech))
    assert len(results) == 2
    for (events, deltas), sentence in zip(results, SENTENCES, strict=True):
        assert {e["type"] for e in events} - {PROGRESS} <= VLLM_TYPES
        assert any(e["type"] == "transcription.delta" for e in events)
        done = events[-1]
        assert done["text"] == deltas  # the deltas join to the final text
        assert done["usage"]["type"] == "duration" and 2 < done["usage"]["seconds"] < 6
        # read at 16 kHz: the sentence's words (at OpenAI's 24 kHz they came out 1.5x fast and wrong)
        got, want = words(done["text"]), sentence.split()
        assert sum(w in got for w in want) >= len(want) - 1, done["text"]
    # the same 16 kHz bytes through OpenAI's dialect: the same turns, so the same text
    assert results[0][0][-1]["text"] == openai_text(asyncio.run(openai_client(server, speech[0])))


def test_the_older_vllm_example_without_session_update(server, speech) -> None:
    """vLLM's older example sends no session.update: its first event, a bare commit, tells the dialect."""
    [(events, deltas)] = asyncio.run(vllm_client(server, speech[1:], update=False))
    assert events[-1]["text"] == deltas and words(deltas)[-1] == "bedroom"


def test_a_refused_vllm_update_keeps_the_session_unconfigured(server, speech) -> None:
    async def run() -> list[dict]:
        async with websockets.connect(url(server)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "model": 5}))
            await ws.send(append(speech[0][:3200]))
            errors = []
            while len(errors) < 2:
                event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if event["type"] != PROGRESS:
                    errors.append(event)
            await ws.send(json.dumps({"type": "session.update", "model": "qwen3-asr"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            for i in range(0, len(speech[0]), 4096):
                await ws.send(append(speech[0][i:i + 4096]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            return errors + (await until_done(ws))[0]

    events = asyncio.run(run())
    refused, audio_refused = events[:2]
    assert refused == {"type": "error", "error": refused["error"], "code": "invalid_event"}  # vLLM's shape
    assert "model" in refused["error"] and "refused until" in refused["error"]
    assert audio_refused["code"] == "session_not_configured"
    assert words(events[-1]["text"])[:2] == ["remind", "me"]  # after a valid update, audio is read again


@pytest.mark.parametrize("update", [
    {"type": "session.update", "session": {"type": "transcription",
                                           "audio": {"input": {"format": {"type": "audio/pcm", "rate": 96000}}}}},
    {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}, "transcription": {"language": "Klingon"}}}}},
    {"type": "session.update", "session": "16000"},
])
def test_a_refused_openai_update_never_leaves_the_default_rate(server, speech, update) -> None:
    """A refused first update: an error saying so, audio refused until a valid one, then the right text."""
    events = asyncio.run(openai_client(server, speech[0], first_update=update))
    refused = events[1]["error"]
    assert refused["code"] in ("unsupported_format", "unsupported_language", "invalid_session")
    assert "unconfigured" in refused["message"]
    assert words(openai_text(events))[:2] == ["remind", "me"]


def test_vllm_transcript_joins_turns_as_segments() -> None:
    t = VllmTranscript()
    sent = [t.update("hello"), t.update("hello wor"), t.end_turn("hello world."), t.update(""),
            t.update(" again"), t.end_turn("again"), t.update("你好"), t.end_turn("你好。")]
    assert sent == ["hello", " wor", "ld.", "", " again", "", "你好", "。"]
    assert t.take() == "".join(sent) == join_segment_texts(["hello world.", "again", "你好。"])
    assert t.update("next") == "next"  # a new transcription starts empty
