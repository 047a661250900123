"""Live transcription through a real ``qasr serve`` (demo model) over WebSockets: a client written to
OpenAI's Realtime event names (event order per turn, deltas that only append and join to the completed
transcript, which equals what ``ASR.live`` gives for the same bytes), the native protocol, 16 concurrent
sessions, a client that leaves mid-stream freeing its session, protocol errors, the backlog limit, the API
key, idle sessions, the session limit, and ``qasr stream``."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soxr
import websockets
from server_proc import DEMO_MODEL, ROOT, ServerProcess, metric

from qasr.testing.speech import speak

KEY = "live-key-42"
SENTENCES = ("set an alarm for six forty five", "turn off the lights in the bedroom",
             "what is the weather like in paris on friday")
IDLE_S = 3
MAX_SESSIONS = 18
BACKLOG_S = 8
PROGRESS = "input_audio_buffer.progress"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, object]:
    from qasr.audio.io import load_audio

    d = tmp_path_factory.mktemp("live_audio")
    paths = [speak(s, d / f"c{k}.wav", speed=150 + 10 * k) for k, s in enumerate(SENTENCES)]
    waves = [load_audio(p) for p in paths]
    gap = np.zeros(16000, np.float32)
    three = np.concatenate([gap, waves[0], gap, waves[1], gap, waves[2], gap])
    import soundfile as sf

    sf.write(d / "three.wav", three, 16000)
    return {"paths": paths, "waves": waves, "three": three, "three_path": d / "three.wav"}


@pytest.fixture(scope="module")
def offline(clips) -> list[str]:
    from qasr import ASR

    asr = ASR.from_pretrained(DEMO_MODEL, device="cpu", dtype="float32")
    texts = [r.text for r in asr.transcribe([str(p) for p in clips["paths"]])]
    asr.close()
    return texts


@pytest.fixture(scope="module")
def live_reference(offline):
    """The final transcripts a session must send for a byte stream: an in-process ``LiveSession`` with the
    server's default settings (1 s chunks, the same VAD) fed the same bytes through the same ``PcmIngest``.
    The server adds nothing to the streaming algorithm, so its turns equal these exactly; they need not
    equal the offline transcripts (docs/streaming.md: a turn's last step continues a rolled-back prefix, and
    the demo model can continue one differently), so they are only checked to be close to them."""
    from qasr import ASR
    from qasr.streaming import LiveConfig, StreamConfig, TurnFinal
    from qasr.streaming.ingest import PcmIngest

    asr = ASR.from_pretrained(DEMO_MODEL, device="cpu", dtype="float32")

    @functools.cache  # both qasr stream protocols send the same bytes
    def reference(data: bytes, pcm_format: str, rate: int) -> tuple[str, ...]:
        ingest, live = PcmIngest(pcm_format, rate), asr.live(LiveConfig(StreamConfig(chunk_size_sec=1.0)))
        step = rate * (2 if pcm_format == "pcm16" else 4) // 10  # 100 ms pieces
        events = []
        for i in range(0, len(data), step):
            events += live.push(ingest.feed(data[i:i + step]))
        events += live.push(ingest.flush())
        events += live.finish()
        texts = [e.text for e in events if isinstance(e, TurnFinal)]
        assert len(texts) == len(offline) and sum(a == b for a, b in zip(texts, offline, strict=True)) >= 2, texts
        return tuple(texts)

    yield reference
    asr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("live_server") / "serve.log", "--live-idle-timeout-s", str(IDLE_S),
                      "--max-live-sessions", str(MAX_SESSIONS), "--live-max-backlog-s", str(BACKLOG_S),
                      api_key=KEY) as srv:
        yield srv


def ws_url(server: ServerProcess, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def pcm16(wave: np.ndarray, rate: int) -> bytes:
    if rate != 16000:
        wave = soxr.resample(wave, 16000, rate)
    return (np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes()


def realtime_connect(server: ServerProcess, **kwargs):  # noqa: ANN201
    return websockets.connect(ws_url(server, "/v1/realtime?intent=transcription"),
                              additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None, **kwargs)


def native_connect(server: ServerProcess):  # noqa: ANN201
    return websockets.connect(ws_url(server, "/v1/stream"), additional_headers={"Authorization": f"Bearer {KEY}"},
                              max_size=None)


async def openai_session(server: ServerProcess, wave: np.ndarray, rate: int = 24000, speed: float = 8.0,
                         language: str | None = None) -> list[dict]:
    """Stream ``wave`` the way an OpenAI Realtime client does (pcm16 at ``rate`` in base64 appends, then a
    commit) and return every server event up to the end of the stream (our ``cleared`` after a clear)."""
    events: list[dict] = []
    async with realtime_connect(server) as ws:
        events.append(json.loads(await ws.recv()))
        audio_in = {"format": {"type": "audio/pcm", "rate": rate},
                    "transcription": {"model": "qwen3-asr", "language": language},
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}
        await ws.send(json.dumps({"type": "session.update",
                                  "session": {"type": "transcription", "audio": {"input": audio_in}}}))

        async def send() -> None:
            data, step = pcm16(wave, rate), rate // 10 * 2  # 100 ms per append
            for i in range(0, len(data), step):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(data[i:i + step]).decode()}))
                await asyncio.sleep(0.1 / speed)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))

        sender = asyncio.create_task(send())
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            events.append(event)
            if event["type"] == "input_audio_buffer.cleared":
                break
        await sender
    return events


def turns(events: list[dict]) -> list[dict]:
    """Per item: its event types in order, its deltas joined, and its completed transcript."""
    items: dict[str, dict] = {}
    for e in events:
        item = e.get("item_id")
        if item is None:
            continue
        t = items.setdefault(item, {"types": [], "deltas": "", "transcript": None, "stables": []})
        t["types"].append(e["type"])
        if e["type"].endswith("transcription.delta"):
            t["deltas"] += e["delta"]
        elif e["type"].endswith("transcription.completed"):
            t["transcript"] = e["transcript"]
        elif e["type"].endswith("transcription.partial"):
            t["stables"].append(e["stable"])
    return list(items.values())


def assert_openai_turn(t: dict) -> None:
    types = [x.removeprefix("conversation.item.").removeprefix("input_audio_buffer.") for x in t["types"]]
    assert types[0] == "speech_started"
    stop = types.index("speech_stopped")
    assert types[-2:] == ["committed", "input_audio_transcription.completed"]
    # results arrive while speaking and, from the pause to the turn's chunk boundary (end_on_chunk), after it
    results = {"input_audio_transcription.delta", "input_audio_transcription.partial"}
    assert set(types[1:stop]) <= results and set(types[stop + 1:-2]) <= results
    assert t["deltas"] == t["transcript"]  # deltas only append and join to the final transcript
    for a, b in zip(t["stables"], t["stables"][1:], strict=False):
        assert b.startswith(a)  # stable text never changes once sent
    assert all(t["deltas"].startswith(s) for s in t["stables"])


def test_openai_realtime_turns_match_the_api(server, clips, live_reference) -> None:
    expected = live_reference(pcm16(clips["three"], 24000), "pcm16", 24000)
    events = asyncio.run(openai_session(server, clips["three"], rate=24000))
    assert [e["type"] for e in events[:3]] == ["session.created", PROGRESS, "session.updated"]
    assert events[1]["audio_processed_ms"] == 0 and events[1]["max_backlog_ms"] == BACKLOG_S * 1000
    assert events[2]["session"]["audio"]["input"]["format"]["rate"] == 24000
    progress = [e["audio_processed_ms"] for e in events if e["type"] == PROGRESS]
    assert progress == sorted(progress) and progress[-1] >= (len(clips["three"]) / 16000 - 1) * 1000
    got = turns(events)
    assert len(got) == 3
    for t, text in zip(got, expected, strict=True):
        assert_openai_turn(t)
        assert t["transcript"] == text
    # partial results arrived while speaking, before the turn's speech_stopped
    partial = "conversation.item.input_audio_transcription.partial"
    assert any(partial in t["types"][:t["types"].index("input_audio_buffer.speech_stopped")] for t in got)


def test_native_protocol_float32(server, clips, live_reference) -> None:
    async def run() -> list[dict]:
        async with native_connect(server) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000, "format": "float32"}))
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready" and ready["config"]["format"] == "float32"
            data = clips["three"].astype("<f4").tobytes()
            for i in range(0, len(data), 12800):  # 200 ms a message at 4x real time (the backlog limit is 8 s)
                await ws.send(data[i:i + 12800])
                await asyncio.sleep(0.05)
            await ws.send(json.dumps({"type": "end"}))
            out = [json.loads(m) async for m in ws]
            assert ws.close_code == 1000
            return out

    async def forced_language_and_nothing_said() -> list[dict]:
        async with native_connect(server) as ws:
            await ws.send(json.dumps({"type": "start", "language": "en", "silence_ms": 300}))
            await ws.send(json.dumps({"type": "end"}))
            return [json.loads(m) async for m in ws]

    ready, done = asyncio.run(forced_language_and_nothing_said())
    assert ready["config"]["language"] == "English" and ready["config"]["silence_ms"] == 300
    assert done == {"type": "done", "session": ready["session"], "turns": 0, "audio_seconds": 0.0}
    messages = asyncio.run(run())
    assert not [m for m in messages if m["type"] == "error"]
    finals = [m for m in messages if m["type"] == "final"]
    expected = live_reference(clips["three"].astype("<f4").tobytes(), "float32", 16000)
    assert [f["text"] for f in finals] == list(expected) and [f["turn"] for f in finals] == [0, 1, 2]
    assert messages[-1]["type"] == "done" and messages[-1]["turns"] == 3
    assert messages[-1]["audio_seconds"] == pytest.approx(len(clips["three"]) / 16000, abs=0.01)
    for f in finals:
        partials = [m for m in messages if m["type"] == "partial" and m["turn"] == f["turn"]]
        assert "".join(p["delta"] for p in partials) + f["delta"] == f["text"]


def wait_metric(server: ServerProcess, name: str, value: float, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
        if metric(text, name) == value or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_16_concurrent_sessions(server, clips, offline) -> None:
    async def run() -> list[list[dict]]:
        return await asyncio.gather(*(openai_session(server, clips["waves"][k % 3], rate=(24000, 16000)[k % 2],
                                                     speed=2.0) for k in range(16)))

    started = time.monotonic()
    results = asyncio.run(run())
    took = time.monotonic() - started
    for k, events in enumerate(results):
        got = turns(events)
        assert len(got) == 1, f"session {k}: {len(got)} turns"
        assert_openai_turn(got[0])
        assert got[0]["transcript"] == offline[k % 3]
    text = wait_metric(server, "qasr_live_sessions", 0)
    assert metric(text, "qasr_live_sessions") == 0
    print(f"16 concurrent sessions of {max(len(w) for w in clips['waves']) / 16000:.1f} s sent at 2x: {took:.1f} s")


def test_a_client_that_leaves_mid_stream_frees_its_session(server, clips) -> None:
    async def leave() -> None:
        async with realtime_connect(server) as ws:
            await ws.recv()
            data = pcm16(clips["three"], 24000)
            for i in range(0, len(data) // 2, 9600):  # half the stream, then gone without a word
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(data[i:i + 9600]).decode()}))
            while json.loads(await ws.recv())["type"] != "input_audio_buffer.speech_started":
                pass
            assert metric(httpx.get(f"{server.url}/metrics", headers=server.headers).text, "qasr_live_sessions") == 1
            ws.transport.abort()  # no close frame: the connection just drops

    asyncio.run(leave())
    text = wait_metric(server, "qasr_live_sessions", 0)
    assert metric(text, "qasr_live_sessions") == 0
    text = wait_metric(server, "qasr_engine_kv_tokens_used", 0)
    assert metric(text, "qasr_engine_kv_tokens_used") == 0


def test_protocol_errors_are_events_and_the_session_goes_on(server, clips, offline) -> None:
    async def run() -> list[dict]:
        async with realtime_connect(server) as ws:
            await ws.recv()

            async def ask(event: object) -> dict:
                """Send ``event``; the error it causes. Once audio is in, the session's own events (progress,
                speech_started) may come first, in whatever order the two tasks run: they are passed over."""
                await ws.send(event if isinstance(event, str) else json.dumps(event))
                while (reply := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "error":
                    pass
                return reply

            assert json.loads(await ws.recv())["type"] == PROGRESS  # the backlog, announced at the start
            errors = [await ask("not json"), await ask({"type": "response.create", "event_id": "e1"}),
                      await ask({"type": "input_audio_buffer.append", "audio": "@@@"}),
                      await ask({"type": "session.update", "session": {"audio": {"input": {"format": {
                          "type": "audio/pcmu"}}}}}),
                      await ask({"type": "session.update", "session": {"audio": {"input": {"transcription": {
                          "language": "klingon"}}}}})]
            # refused updates left the session unconfigured (docs/streaming.md): a valid one lets audio in
            await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {
                "type": "audio/pcm", "rate": 24000}}}}}))
            errors.append(await ask({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm16(clips["waves"][0], 24000)).decode()}))
            errors.append(await ask({"type": "session.update", "session": {"audio": {"input": {"format": {
                "type": "audio/pcm", "rate": 16000}}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            completed = "conversation.item.input_audio_transcription.completed"
            while (event := json.loads(await ws.recv()))["type"] != completed:
                pass
            return [*errors, event]

    *errors, completed = asyncio.run(run())
    codes = [e["error"]["code"] for e in errors]
    assert codes == ["invalid_json", "unknown_event", "invalid_audio", "unsupported_format", "unsupported_language",
                     "input_audio_buffer_commit_empty", "session_busy"]
    assert all(e["type"] == "error" and e["error"]["message"] for e in errors)
    assert errors[1]["error"]["event_id"] == "e1"
    assert completed["transcript"] == offline[0]  # the session survived every error


def test_audio_sent_faster_than_transcribed_waits_and_is_never_dropped(server, clips, offline) -> None:
    """Three times the clip's 12 s at once, in 2 s appends and one 10 s append bigger than the whole 8 s
    backlog: no error, every turn transcribed; while the backlog is full the session takes nothing (its
    progress events never show more waiting than the limit and one append)."""
    async def run() -> list[dict]:
        async with realtime_connect(server) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
            data = pcm16(np.tile(clips["three"], 3), 16000)
            sizes = [16000 * 2 * 10] + [16000 * 2 * 2] * (len(data) // (16000 * 4) + 1)
            at = 0
            for size in sizes:  # as fast as the socket takes them
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(data[at:at + size]).decode()}))
                at += size
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            events = []
            while (event := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] != "input_audio_buffer.cleared":
                events.append(event)
            return events

    events = asyncio.run(run())
    errors = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert errors in ([], ["input_audio_buffer_commit_empty"])  # (the VAD may have ended the last turn already)
    got = turns(events)
    assert len(got) == 9 and all(t["transcript"] for t in got)
    assert sum(t["transcript"] == offline[k % 3] for k, t in enumerate(got)) >= 6
    progress = [e for e in events if e["type"] == PROGRESS]
    assert max(e["backlog_ms"] for e in progress) <= (BACKLOG_S + 10) * 1000  # the limit plus one message
    assert progress[-1]["audio_processed_ms"] >= (3 * len(clips["three"]) / 16000 - 1) * 1000


def test_api_key_header_or_browser_subprotocol(server) -> None:
    async def run() -> tuple:
        async with websockets.connect(ws_url(server, "/v1/realtime?intent=transcription")) as ws:
            refused = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            refused_code = ws.close_code
        async with websockets.connect(ws_url(server, "/v1/realtime?intent=transcription"),
                                      subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
            created = json.loads(await ws.recv())
            chosen = ws.subprotocol
        return refused, refused_code, created, chosen

    refused, code, created, chosen = asyncio.run(run())
    assert refused["error"]["code"] == "invalid_api_key" and code == 1008
    assert created["type"] == "session.created" and chosen == "realtime"


def test_an_idle_session_is_closed(server) -> None:
    async def run() -> tuple[dict, int | None, float]:
        async with realtime_connect(server) as ws:
            await ws.recv()
            assert json.loads(await ws.recv())["type"] == PROGRESS
            started = time.monotonic()
            event = json.loads(await asyncio.wait_for(ws.recv(), IDLE_S + 10))
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            return event, ws.close_code, time.monotonic() - started

    event, code, waited = asyncio.run(run())
    assert event["error"]["code"] == "session_idle" and code == 1000
    assert IDLE_S - 0.5 < waited < IDLE_S + 5
    assert metric(wait_metric(server, "qasr_live_sessions", 0), "qasr_live_sessions") == 0


def test_sessions_over_the_limit_are_refused(server) -> None:
    async def run() -> dict:
        held = [await realtime_connect(server).__aenter__() for _ in range(MAX_SESSIONS)]
        try:
            for ws in held:
                assert json.loads(await ws.recv())["type"] == "session.created"
            async with realtime_connect(server) as extra:
                return json.loads(await extra.recv())
        finally:
            for ws in held:
                await ws.close()

    event = asyncio.run(run())
    assert event["error"]["code"] == "too_many_sessions"
    assert metric(wait_metric(server, "qasr_live_sessions", 0), "qasr_live_sessions") == 0


@pytest.mark.parametrize("protocol", ["native", "openai"])
def test_qasr_stream_prints_the_live_transcript(server, clips, live_reference, protocol) -> None:
    from qasr.audio.io import load_audio

    expected = live_reference(pcm16(load_audio(clips["three_path"]), 16000), "pcm16", 16000)  # as qasr stream sends
    cmd = [sys.executable, "-m", "qasr", "stream", str(clips["three_path"]), "--server", server.url,
           "--protocol", protocol, "--speed", "4", "--api-key", KEY]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == list(expected)
    assert lines[0].startswith("[0:00.")


def test_qasr_stream_json_and_partials(server, clips, offline) -> None:
    base = [sys.executable, "-m", "qasr", "stream", str(clips["paths"][1]), "--server", server.url, "--speed", "0",
            "--api-key", KEY, "--no-turn-detection"]
    done = subprocess.run([*base, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert {e["event"] for e in events} == {"partial", "final"}
    assert [e["text"] for e in events if e["event"] == "final"] == [offline[1]]
    done = subprocess.run([*base, "--partials"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    lines = done.stdout.splitlines()
    assert lines[-1].endswith(offline[1]) and all(line.startswith("~ ") for line in lines[:-1]) and len(lines) > 1


def test_qasr_stream_reports_a_server_that_is_not_there(tmp_path: Path, clips) -> None:
    cmd = [sys.executable, "-m", "qasr", "stream", str(clips["three_path"]), "--server", "http://127.0.0.1:9"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "error" in done.stderr
    missing = subprocess.run([sys.executable, "-m", "qasr", "stream", str(tmp_path / "nope.wav")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr


@pytest.mark.slow
def test_sigterm_gives_open_sessions_their_final_transcript(tmp_path: Path, clips, offline) -> None:
    srv = ServerProcess(tmp_path / "serve.log")
    try:
        srv.wait_ready()

        async def run() -> tuple[list[dict], int | None]:
            async with websockets.connect(ws_url(srv, "/v1/stream"), max_size=None) as ws:
                await ws.send(json.dumps({"type": "start", "turn_detection": False}))
                await ws.recv()
                await ws.send(pcm16(clips["waves"][0], 16000))  # one turn, never ended by the client
                await asyncio.sleep(0.5)
                srv.proc.terminate()  # SIGTERM: drain
                out = [json.loads(m) async for m in ws]
                return out, ws.close_code

        messages, code = asyncio.run(run())
        finals = [m for m in messages if m["type"] == "final"]
        assert [f["text"] for f in finals] == [offline[0]] and finals[0]["reason"] == "finish"
        assert messages[-1] == {"type": "error", "code": "shutting_down", "message": "the server is shutting down"}
        assert code == 1001
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", ["on", "off"])
def test_the_servers_end_on_chunk_default_and_the_start_message_that_changes_it(tiny_asr, flag: str) -> None:  # noqa: ANN001
    """``qasr serve --live-end-on-chunk on|off`` (off by default) sets live sessions' default (a ``/v1/realtime``
    session takes it as it is); a ``/v1/stream`` start message may set ``end_on_chunk`` for its session, and
    ``ready`` reports it."""
    from qasr.cli.main import build_parser
    from qasr.cli.serve import server_config
    from qasr.server.metrics import Metrics
    from qasr.server.native_stream import _describe, _session_config
    from qasr.server.realtime import RealtimeConnection
    from qasr.server.state import ServerState

    assert server_config(build_parser().parse_args(["serve", "-m", "some-model"])).live_end_on_chunk is False
    args = build_parser().parse_args(["serve", "-m", "some-model", "--live-end-on-chunk", flag])
    config = server_config(args)
    assert config.live_end_on_chunk is (flag == "on")
    state = ServerState(config, Metrics())
    state.asr = tiny_asr
    live, ingest = _session_config({"type": "start"}, state)
    assert live.end_on_chunk is (flag == "on") and _describe(live, ingest)["end_on_chunk"] is (flag == "on")
    live, _ = _session_config({"type": "start", "end_on_chunk": flag == "off"}, state)
    assert live.end_on_chunk is (flag == "off")

    async def realtime_default() -> bool:
        realtime = RealtimeConnection(None, state)  # type: ignore[arg-type] - its runner is built without the socket
        try:
            return realtime.runner.session.config.end_on_chunk
        finally:
            await realtime.runner.close()

    assert asyncio.run(realtime_default()) is (flag == "on")
