"""A real ``qasr serve`` (demo model) and its engine process: SIGKILL of the engine process with an HTTP
transcription and live sessions in flight ends each with an error within seconds, /health is 503
("restarting") until a new engine process is ready and 200 after, the same file gives the same text, and
/metrics counts the restart; SIGTERM with the engine busy leaves no process behind within the drain deadline;
SIGKILL of the server ends the engine process too. Whole-product runs: marked slow (the default suite's
recovery test is tests/engine_process/test_recovery.py's SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from server_proc import ServerProcess, gone, metric, until_closed

from qasr.testing.speech import speak

pytestmark = pytest.mark.slow
SENTENCES = ("set an alarm for six forty five", "turn off the lights in the bedroom",
             "what is the weather like in paris on friday")
SECONDS = 10.0  # what "within seconds" allows on a loaded 2-core machine
FAULTS = Path(__file__).resolve().parent.parent / "engine_process" / "faults"


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``short``: one sentence (a file); ``long``: the sentences over and over for 4 minutes (a file the engine
    is busy with for a while); ``pcm``: the sentences as 16 kHz int16 bytes for a live session."""
    from qasr.audio.io import load_audio

    d = tmp_path_factory.mktemp("engine_process_audio")
    waves = [load_audio(speak(s, d / f"s{k}.wav", speed=150 + 10 * k)) for k, s in enumerate(SENTENCES)]
    gap = np.zeros(8000, np.float32)
    three = np.concatenate([w for wave in waves for w in (wave, gap)])
    sf.write(d / "long.wav", np.tile(three, int(240 * 16000 // len(three)) + 1), 16000)
    return {"short": d / "s0.wav", "long": d / "long.wav",
            "pcm": (np.clip(three, -1, 1) * 32767).astype("<i2").tobytes()}


def fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file whose words the next server's engine process does at its next step (faults/sitecustomize.py)."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("QASR_TEST_FAULT", str(fault))
    return fault


def slow_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next engine process steps 0.1 s slower each time (the ``slow`` fault); a restarted one does not."""
    fault_file(tmp_path, monkeypatch).write_text("slow")


def transcribe(srv: ServerProcess, path: Path) -> httpx.Response:
    with path.open("rb") as f:
        return httpx.post(f"{srv.url}/v1/audio/transcriptions", data={"model": "demo"}, files={"file": f},
                          timeout=300)


async def engine_busy(client: httpx.AsyncClient, beyond: int = 0, timeout: float = 60) -> None:
    """Once the engine holds more than ``beyond`` requests, running or waiting (the long file's are in)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        held = metric(text, "qasr_engine_running_requests") + metric(text, "qasr_engine_waiting_requests")
        if held > beyond:
            return
        assert time.monotonic() < deadline, "the engine never got the request"
        await asyncio.sleep(0.05)


async def open_stream(srv: ServerProcess) -> websockets.ClientConnection:
    ws = await websockets.connect(srv.url.replace("http", "ws") + "/v1/stream", max_size=None)
    await ws.send(json.dumps({"type": "start", "turn_detection": False}))
    assert json.loads(await ws.recv())["type"] == "ready"
    return ws


async def first_partial(ws: websockets.ClientConnection, pcm: bytes) -> None:
    """Send ``pcm`` and wait for the session's first partial: its turn is open in the engine process."""
    await ws.send(pcm)
    while json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] != "partial":
        pass


async def keep_sending(ws: websockets.ClientConnection, pcm: bytes) -> None:
    """A live client: 100 ms of audio every 100 ms until the server closes the session."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            for i in range(0, len(pcm), 3200):
                await ws.send(pcm[i:i + 3200])
                await asyncio.sleep(0.1)


def test_sigkill_of_the_engine_process_mid_request_and_live_sessions(
        tmp_path: Path, audio, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    slow_engine(tmp_path, monkeypatch)  # the long file is still in hand when the kill comes, on any machine
    with ServerProcess(tmp_path / "serve.log") as srv:
        before = transcribe(srv, audio["short"])
        assert before.status_code == 200 and before.json()["text"], before.text
        pid = srv.engine_pid()

        async def run() -> tuple:
            streaming, quiet = await open_stream(srv), await open_stream(srv)
            await first_partial(streaming, audio["pcm"][:64000])
            await first_partial(quiet, audio["pcm"][:64000])  # then sends nothing: its turn stays open
            sender = asyncio.create_task(keep_sending(streaming, audio["pcm"][64000:]))
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                with audio["long"].open("rb") as f:
                    posted = asyncio.create_task(client.post("/v1/audio/transcriptions", data={"model": "demo"},
                                                             files={"file": f}))
                    await engine_busy(client, beyond=2)  # the two sessions' open turns are two requests
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
                    r = await asyncio.wait_for(posted, 60)
                    r_s = time.monotonic() - killed

                async def ended(ws: websockets.ClientConnection) -> tuple[list[dict], int | None, float]:
                    events, code = await asyncio.wait_for(until_closed(ws), 60)
                    return events, code, time.monotonic() - killed

                live = await ended(streaming)
                await sender
                # restarting, then ready again
                seen = await asyncio.to_thread(wait_health, srv, 120)
                # the quiet session's turn went with the engine process: it is told without sending anything
                quiet_end = await asyncio.wait_for(until_closed(quiet), SECONDS)
            return r, r_s, live, seen, quiet_end

        r, r_s, (events, code, took), seen, (quiet_events, quiet_code) = asyncio.run(run())
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_broken", r.text
        assert r_s < SECONDS
        errors = [e for e in events if e["type"] == "error"]
        assert errors and errors[-1]["code"] == "server_error", events
        assert "EngineBroken" in errors[-1]["message"] or "EngineLost" in errors[-1]["message"], errors
        assert code == 1011 and took < SECONDS
        assert seen[0] == (503, "restarting") and seen[-1] == (200, "ok"), seen
        errors = [e for e in quiet_events if e["type"] == "error"]
        assert errors and errors[-1]["code"] == "server_error", errors
        assert "engine process ended" in errors[-1]["message"] or "EngineBroken" in errors[-1]["message"], errors
        assert quiet_code == 1011
        assert gone(pid)
        assert srv.engine_pid() != pid
        after = transcribe(srv, audio["short"])
        assert after.status_code == 200 and after.json()["text"] == before.json()["text"]
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "qasr_engine_restarts_total") == 1, [ln for ln in text.splitlines() if "restart" in ln]


def wait_health(srv: ServerProcess, timeout: float) -> list[tuple[int, str]]:
    """The (status code, status) answers of /health, each change once, until it is 200."""
    deadline = time.monotonic() + timeout
    seen: list[tuple[int, str]] = []
    while True:
        r = httpx.get(f"{srv.url}/health", timeout=10)
        answer = (r.status_code, r.json()["status"])
        if not seen or seen[-1] != answer:
            seen.append(answer)
        if r.status_code == 200:
            return seen
        assert time.monotonic() < deadline, f"/health not 200 within {timeout} s: {seen}"
        time.sleep(0.05)


def test_sigterm_with_the_engine_busy_leaves_no_process(
        tmp_path: Path, audio, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Every engine step lasts 0.1 s more (the ``slow`` fault): the long file outlasts the drain on any machine."""
    drain_s = 0.5
    slow_engine(tmp_path, monkeypatch)
    with ServerProcess(tmp_path / "serve.log", "--drain-timeout", str(drain_s)) as srv:
        pid = srv.engine_pid()

        async def run() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                with audio["long"].open("rb") as f:
                    posted = asyncio.create_task(client.post("/v1/audio/transcriptions", data={"model": "demo"},
                                                             files={"file": f}))
                    await engine_busy(client)
                    srv.proc.terminate()
                    at = time.monotonic()
                    r = await asyncio.wait_for(posted, 60)
            await asyncio.to_thread(srv.proc.wait, drain_s + SECONDS)
            return r, time.monotonic() - at

        r, took = asyncio.run(run())
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert took < drain_s + SECONDS and srv.proc.returncode == 1
        deadline = time.monotonic() + SECONDS
        while not gone(pid):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.05)


def test_sigkill_of_the_server_ends_the_engine_process(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "serve.log") as srv:
        pid = srv.engine_pid()
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + SECONDS
        while not gone(pid):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.05)


def test_the_server_answers_while_its_engine_process_hangs_holding_its_gil(
        tmp_path: Path, audio, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The engine process stops reading its pipe (a step that never returns, holding the GIL: injected by
    tests/engine_process/faults/sitecustomize.py); uploads sent meanwhile do not block the server's event loop:
    /health answers at once, and the requests end with 503 engine_broken when it is given up on."""
    fault = fault_file(tmp_path, monkeypatch)
    timeout_s = 6.0
    with ServerProcess(tmp_path / "serve.log", "--engine-timeout-s", str(timeout_s)) as srv:
        pid = srv.engine_pid()
        fault.write_text("gil")

        async def run() -> tuple[list[httpx.Response], list[float]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                async def post() -> httpx.Response:
                    return await client.post("/v1/audio/transcriptions", data={"model": "demo"},
                                             files={"file": audio["short"].read_bytes()})

                posts = [asyncio.create_task(post())]
                deadline = time.monotonic() + 60
                while fault.exists():
                    assert time.monotonic() < deadline, "the fault never ran"
                    await asyncio.sleep(0.02)
                posts += [asyncio.create_task(post()) for _ in range(4)]  # each more than the pipe holds
                health_s = []
                for _ in range(6):
                    at = time.monotonic()
                    await client.get("/health", timeout=timeout_s + SECONDS)
                    health_s.append(time.monotonic() - at)
                    await asyncio.sleep(0.3)
                return await asyncio.gather(*posts), health_s

        responses, health_s = asyncio.run(run())
        assert max(health_s) < 2.0, health_s
        assert [r.status_code for r in responses] == [503] * 5, [r.text for r in responses]
        assert {r.json()["error"]["code"] for r in responses} == {"engine_broken"}
        assert wait_health(srv, 120)[-1] == (200, "ok")
        assert gone(pid)
