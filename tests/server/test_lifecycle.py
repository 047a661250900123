"""``qasr serve`` start and stop: /health is 503 until the model is loaded and warmed up; SIGTERM under load
refuses new requests (503), answers every accepted one (within --drain-timeout), and exits 0. The drain's
deadline itself is tested in test_stream_resilience.py."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
from server_proc import ServerProcess, metric

from qasr.testing.speech import speak

SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "turn off the lights",
             "what is the weather", "play some music", "remind me at nine")
CLIENTS = 16


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("lifecycle")
    parts = []
    for k in range(8):  # ~25 s of speech: one piece per request, enough work to be caught mid-flight
        wave, sr = sf.read(speak(SENTENCES[k % 6], d / "part.wav"), dtype="float32")
        parts += [wave, np.zeros(int(sr * 0.5), np.float32)]
    sf.write(d / "clip.wav", np.concatenate(parts), sr)
    return d / "clip.wav"


@pytest.mark.slow
def test_health_waits_for_the_model_and_sigterm_drains(tmp_path, clip) -> None:
    srv = ServerProcess(tmp_path / "serve.log", "--drain-timeout", "600")  # all of it finishes, however slow
    try:
        srv.wait_ready()
        assert 503 in srv.health_seen and srv.health_seen[-1] == 200  # loading first, then ready
        url = f"{srv.url}/v1/audio/transcriptions"
        expected = httpx.post(url, files={"file": clip.open("rb")}, timeout=60).json()["text"]
        assert expected  # (the toy model reads long clips poorly; only sameness matters here)

        def one(k: int) -> tuple[int, str]:
            data = {"stream": "true"} if k % 2 else {}
            r = httpx.post(url, files={"file": clip.open("rb")}, data=data, timeout=120)
            text = r.text.rsplit('"text":"', 1)[-1].split('"', 1)[0] if k % 2 else r.json().get("text", "")
            return r.status_code, text

        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(one, k) for k in range(CLIENTS)]
            deadline = time.monotonic() + 60
            while metric(httpx.get(f"{srv.url}/metrics").text, "qasr_requests_in_flight") < CLIENTS + 1:
                assert time.monotonic() < deadline, "the requests never were all in flight"
                time.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            late = httpx.post(url, files={"file": clip.open("rb")}, timeout=60)
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
            assert httpx.get(f"{srv.url}/health").status_code == 503
            answers = [f.result() for f in futures]
        assert answers == [(200, expected)] * CLIENTS  # every accepted request answered in full
        assert srv.proc.wait(60) == 0
        log = srv.log()
        assert "Traceback" not in log and "finishing" in log
    finally:
        srv.stop()
