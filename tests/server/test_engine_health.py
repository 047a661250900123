"""/health tells the truth about the engines, and live sessions survive a wedged one: a real uvicorn server on
127.0.0.1 in this process, serving a tiny random checkpoint, with a fault injected into its engine core's
runner (or an aligner's loop). A failing loop makes /health 503 ("broken", naming the engine) and /metrics
say so, and the request that met it 503; a step that never returns makes /health 503 ("stalled") past
``engine_timeout_s``, and ends the live sessions and the HTTP requests (plain and streamed) waiting on it with
an error soon after, freeing their places. /v1/stream refuses start settings outside the served ranges."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
import uvicorn
import websockets
from server_proc import free_port, metric, until_closed

from qasr.engine.errors import EngineBroken
from qasr.server.app import create_app
from qasr.server.config import ServerConfig

TIMEOUT_S = 2.0  # the servers' engine_timeout_s
SLACK_S = 15.0  # what a loaded 2-core machine may add to it
MAX_SESSIONS = 2


class Fatal(BaseException):
    """Not an Exception: the engine loop treats it as fatal (a request's own error is an Exception)."""


@contextlib.contextmanager
def serving(model: str, aligner: str | None = None) -> Iterator[tuple[str, object]]:
    """``(url, app)`` of a ready server on the tiny checkpoint ``model`` (and ``aligner``), stopped at the end."""
    from qasr.transcribe.asr import ASR

    config = ServerConfig(model=model, served_names=("tiny",), warmup=False, engine_timeout_s=TIMEOUT_S,
                          max_live_sessions=MAX_SESSIONS, aligner=aligner)
    app = create_app(config, lambda: ASR.from_pretrained(model, device="cpu", dtype="float32", aligner=aligner))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: health(url)[0] == 200, 120, "the server never became ready")
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if condition():
                return
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=10)
    return r.status_code, r.json()


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def noise_pcm16(seconds: float) -> bytes:
    wave = np.random.default_rng(0).standard_normal(int(16000 * seconds)) * 0.1
    return (np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def served(tiny_original) -> Iterator[tuple[str, object]]:  # noqa: ANN001 - a path fixture
    with serving(str(tiny_original)) as server:
        yield server


def test_health_is_503_once_the_engine_breaks(tiny_original, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    with serving(str(tiny_original)) as (url, app):
        text = scrape(url)
        assert metric(text, "qasr_engine_broken", engine="asr") == 0
        assert metric(text, "qasr_engine_stalled_seconds", engine="asr") == 0
        core = app.state.qasr.asr._core.engine.core

        def fail(plan: object) -> object:
            raise Fatal("the device went away")

        monkeypatch.setattr(core.runner, "forward", fail)
        wav = noise_pcm16(1.0)
        r = httpx.post(f"{url}/v1/audio/transcriptions", timeout=60, data={"model": "tiny"},
                       files={"file": ("n.raw", wav_file(wav), "audio/wav")})
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": "the inference engine is broken and serves no more requests: "
                                                "Fatal('the device went away')", "type": "server_error",
                                     "param": None, "code": "engine_broken"}
        status, body = health(url)
        assert status == 503 and body["status"] == "broken", body
        assert body["error"].startswith("asr engine broken: its loop failed"), body
        assert metric(scrape(url), "qasr_engine_broken", engine="asr") == 1


def test_health_names_a_broken_aligner_engine(tiny_original, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from qasr.testing.checkpoint import make_tiny_aligner_checkpoint

    aligner_path = make_tiny_aligner_checkpoint(tmp_path / "aligner", seed=1)
    with serving(str(tiny_original), str(aligner_path)) as (url, app):
        text = scrape(url)
        assert metric(text, "qasr_engine_broken", engine="asr") == metric(text, "qasr_engine_broken", engine="aligner")
        assert metric(text, "qasr_engine_broken", engine="aligner") == 0 and "engine=\"aligner\"" in text
        aligner = app.state.qasr.asr._core.aligner

        def fail() -> None:
            raise Fatal("the loop itself failed")

        monkeypatch.setattr(aligner.engine.core, "step", fail)
        wave = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1
        with pytest.raises(EngineBroken):
            aligner.align((wave, 16000), "set an alarm", language="English")
        status, body = health(url)
        assert status == 503 and body["status"] == "broken" and body["error"].startswith("aligner engine broken")
        text = scrape(url)
        assert metric(text, "qasr_engine_broken", engine="aligner") == 1
        assert metric(text, "qasr_engine_broken", engine="asr") == 0


def wav_file(pcm: bytes) -> bytes:
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.frombuffer(pcm, "<i2"), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def open_stream(url: str) -> websockets.ClientConnection:
    ws = await websockets.connect(url.replace("http", "ws") + "/v1/stream", max_size=None)
    await ws.send(json.dumps({"type": "start", "turn_detection": False}))
    assert json.loads(await ws.recv())["type"] == "ready"
    return ws


async def open_realtime(url: str) -> websockets.ClientConnection:
    ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime?intent=transcription", max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}}}}))
    while json.loads(await ws.recv())["type"] != "session.updated":
        pass
    return ws


def test_a_wedged_engine_ends_live_sessions_within_the_timeout_and_frees_them(
        served, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    url, app = served
    state = app.state.qasr
    core = state.asr._core.engine.core
    release = threading.Event()
    real_forward = core.runner.forward
    wedged = threading.Event()

    def wedge(plan: object) -> object:
        wedged.set()
        release.wait(120)
        return real_forward(plan)

    async def run() -> list[tuple[list[dict], int | None, float]]:
        stream, realtime = await open_stream(url), await open_realtime(url)
        assert state.live_sessions == MAX_SESSIONS
        monkeypatch.setattr(core.runner, "forward", wedge)
        sent = time.monotonic()
        await stream.send(noise_pcm16(2.0))
        await realtime.send(json.dumps({"type": "input_audio_buffer.append",
                                        "audio": base64.b64encode(noise_pcm16(2.0)).decode()}))

        async def ended(ws: websockets.ClientConnection) -> tuple[list[dict], int | None, float]:
            events, code = await asyncio.wait_for(until_closed(ws), TIMEOUT_S + SLACK_S)
            return events, code, time.monotonic() - sent

        return await asyncio.gather(ended(stream), ended(realtime))

    try:
        (stream_events, stream_code, stream_s), (realtime_events, realtime_code, realtime_s) = asyncio.run(run())
        assert wedged.is_set()
        stream_error = [e for e in stream_events if e["type"] == "error"]
        assert stream_error and stream_error[-1]["code"] == "server_error", stream_events
        assert stream_error[-1]["message"] == "the engine has not answered for 2 s: the session is closed"
        realtime_error = [e["error"] for e in realtime_events if e["type"] == "error"]
        assert realtime_error and realtime_error[-1]["message"].startswith("the engine has not answered for 2 s")
        assert stream_code == realtime_code == 1011
        assert TIMEOUT_S <= min(stream_s, realtime_s) and max(stream_s, realtime_s) <= TIMEOUT_S + SLACK_S
        wait_until(lambda: state.live_sessions == 0, 10, "the sessions' places were not freed")
        assert metric(scrape(url), "qasr_live_sessions") == 0
        # still wedged: /health says so, and a new session gets a place
        status, body = health(url)
        assert status == 503 and body["status"] == "stalled", body
        assert body["error"].startswith("asr engine stalled for ") and body["error"].endswith(" s with work in hand")
        assert metric(scrape(url), "qasr_engine_stalled_seconds", engine="asr") > TIMEOUT_S

        async def another() -> None:
            await (await open_stream(url)).close()

        asyncio.run(another())
    finally:
        release.set()
    wait_until(lambda: health(url)[0] == 200, 30, "the engine did not recover once released")
    assert metric(scrape(url), "qasr_engine_stalled_seconds", engine="asr") == 0
    # the requests given up on were cancelled: once the engine steps again, they hold no KV
    wait_until(lambda: metric(scrape(url), "qasr_engine_kv_blocks_used") == 0, 30, "the cancelled requests' KV")


def test_a_wedged_engine_ends_http_requests_with_503_within_the_timeout(
        served, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    url, app = served
    core = app.state.qasr.asr._core.engine.core
    release, wedged = threading.Event(), threading.Event()
    real_forward = core.runner.forward

    def wedge(plan: object) -> object:
        wedged.set()
        release.wait(120)
        return real_forward(plan)

    audio = {"file": ("n.wav", wav_file(noise_pcm16(2.0)), "audio/wav")}

    async def run() -> tuple[tuple[httpx.Response, float], tuple[int, str, float]]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S + SLACK_S) as client:
            sent = time.monotonic()

            async def plain() -> tuple[httpx.Response, float]:
                r = await client.post("/v1/audio/transcriptions", data={"model": "tiny"}, files=audio)
                return r, time.monotonic() - sent

            async def streamed() -> tuple[int, str, float]:
                async with client.stream("POST", "/v1/audio/transcriptions", files=audio,
                                         data={"model": "tiny", "stream": "true"}) as r:
                    body = (await r.aread()).decode()
                return r.status_code, body, time.monotonic() - sent

            return await asyncio.gather(plain(), streamed())

    monkeypatch.setattr(core.runner, "forward", wedge)
    try:
        (plain, plain_s), (stream_status, stream_body, stream_s) = asyncio.run(run())
        assert wedged.is_set()
        assert plain.status_code == 503, plain.text
        error = plain.json()["error"]
        assert error["code"] == "engine_stalled" and error["type"] == "server_error", error
        assert error["message"].startswith("asr engine stalled for "), error
        assert error["message"].endswith(" s with work in hand; the request was cancelled"), error
        assert stream_status == 200 and stream_body.startswith("event: error\ndata: "), stream_body
        assert json.loads(stream_body.split("data: ", 1)[1])["error"]["code"] == "engine_stalled", stream_body
        assert TIMEOUT_S <= min(plain_s, stream_s) and max(plain_s, stream_s) <= TIMEOUT_S + SLACK_S
        status, body = health(url)  # still wedged, still answering
        assert status == 503 and body["status"] == "stalled", body
    finally:
        release.set()
    wait_until(lambda: health(url)[0] == 200, 30, "the engine did not recover once released")
    # the requests given up on were cancelled: once the engine steps again, they hold no KV
    wait_until(lambda: metric(scrape(url), "qasr_engine_kv_blocks_used") == 0, 30, "the cancelled requests' KV")
    r = httpx.post(f"{url}/v1/audio/transcriptions", data={"model": "tiny"}, files=audio, timeout=60)
    assert r.status_code == 200 and "text" in r.json(), r.text


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("chunk_size_sec", 0.01, "chunk_size_sec must be from 0.25 to 30, got 0.01"),
    ("max_turn_s", 1e6, "max_turn_s must be from 1 to 120, got 1e+06"),
])
def test_stream_refuses_start_settings_out_of_range(served, setting: str, value: float, message: str) -> None:  # noqa: ANN001
    url, _ = served

    async def run() -> tuple[list[dict], int | None]:
        ws = await websockets.connect(url.replace("http", "ws") + "/v1/stream")
        await ws.send(json.dumps({"type": "start", setting: value}))
        return await until_closed(ws)

    events, code = asyncio.run(run())
    assert events == [{"type": "error", "code": "invalid_start", "message": message}]
    assert code == 4400


def test_the_server_options_of_the_timeout_and_the_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    from qasr.cli.main import build_parser, main
    from qasr.cli.serve import server_config

    parse = build_parser().parse_args
    assert server_config(parse(["serve", "-m", "m"])).engine_timeout_s == 60.0
    assert server_config(parse(["serve", "-m", "m", "--engine-timeout-s", "5"])).engine_timeout_s == 5.0
    assert main(["serve", "-m", "m", "--live-chunk-s", "0.1"]) == 2  # before anything loads
    assert "live_chunk_s must be from 0.25 to 30, got 0.1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="engine_timeout_s must be > 0"):
        ServerConfig(model="m", served_names=("m",), engine_timeout_s=0)
