"""Uploads and live sessions on their own bounded thread pools (engine v3: no tenant stalls another).

A real uvicorn server on 127.0.0.1 in this process, serving the demo model, with one function replaced:
the upload decoder (``qasr.server.routes.prepare_upload``) blocks until the test lets it go, so the test
controls how long every decode thread stays busy. With the loop's shared default executor (a handful of
threads on a small machine) a burst of stalled uploads left no thread for live sessions; with the pools,
the decode pool is full and a live session still runs to its final text.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from server_proc import DEMO_MODEL, free_port

from qasr.server import routes
from qasr.server.app import create_app
from qasr.server.config import ServerConfig
from qasr.testing.speech import speak

DECODE_WORKERS = 2
UPLOADS = 8  # more than the default executor's threads on a 2-core machine (min(32, cores + 4) = 6)


class StalledDecoder:
    """Stands in for ``prepare_upload``: records which threads decode and how many at once, and holds each
    call until ``release`` is set (then decodes for real)."""

    def __init__(self, real) -> None:  # noqa: ANN001 - the replaced function
        self.real = real
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.threads: set[str] = set()

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204 - passed through
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            self.release.wait(60)
            return self.real(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> np.ndarray:
    from qasr.audio.io import load_audio

    return load_audio(speak("turn off the lights in the bedroom", tmp_path_factory.mktemp("pools") / "c.wav"))


@pytest.fixture()
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, StalledDecoder]]:
    import uvicorn

    from qasr.transcribe.asr import ASR

    decoder = StalledDecoder(routes.prepare_upload)
    monkeypatch.setattr(routes, "prepare_upload", decoder)
    config = ServerConfig(model=str(DEMO_MODEL), served_names=("demo",), warmup=False, decode_workers=DECODE_WORKERS,
                          max_live_sessions=4)
    app = create_app(config, lambda: ASR.from_pretrained(str(DEMO_MODEL), device="cpu", dtype="float32"))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.2)
    try:
        yield url, decoder
    finally:
        decoder.release.set()
        srv.should_exit = True
        thread.join(30)


def wav_bytes(wave: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, 16000, format="WAV")
    return buf.getvalue()


async def live_final(url: str, wave: np.ndarray) -> str:
    """One native live session (/v1/stream): the clip, then end of stream; the final turn's text."""
    async with websockets.connect(url.replace("http", "ws") + "/v1/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "turn_detection": False}))
        await ws.recv()
        await ws.send((np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes())
        await ws.send(json.dumps({"type": "end"}))
        async for message in ws:
            event = json.loads(message)
            if event["type"] == "final":
                return event["text"]
    raise AssertionError("the session ended without a final turn")


def test_stalled_uploads_fill_only_their_pool_and_live_sessions_keep_running(server, clip) -> None:
    url, decoder = server

    async def run() -> tuple[list[httpx.Response], str, int]:
        async with httpx.AsyncClient(timeout=120) as client:
            uploads = [asyncio.create_task(client.post(
                f"{url}/v1/audio/transcriptions", data={"model": "demo"},
                files={"file": (f"u{i}.wav", wav_bytes(clip), "audio/wav")})) for i in range(UPLOADS)]
            deadline = time.monotonic() + 60
            while decoder.running < DECODE_WORKERS:  # the decode pool is full, the other uploads wait
                assert time.monotonic() < deadline, "the uploads never reached the decoder"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # give a wrong pool the time to start more decodes
            busy_while_live = decoder.running
            text = await asyncio.wait_for(live_final(url, clip), 60)  # must not wait for the uploads
            decoder.release.set()
            return await asyncio.gather(*uploads), text, busy_while_live

    responses, text, busy = asyncio.run(run())
    assert text.strip(), "the live session gave an empty final text"
    assert busy == DECODE_WORKERS
    assert decoder.most == DECODE_WORKERS  # never more decodes at once than the pool has threads
    assert decoder.threads and all(name.startswith("qasr-decode") for name in decoder.threads), decoder.threads
    assert [r.status_code for r in responses] == [200] * UPLOADS
    texts = {r.json()["text"] for r in responses}
    assert len(texts) == 1 and texts.pop().strip()


def test_decode_workers_is_checked() -> None:
    with pytest.raises(ValueError, match="decode_workers"):
        ServerConfig(model="m", served_names=("m",), decode_workers=0)
