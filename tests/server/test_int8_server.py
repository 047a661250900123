"""``qasr serve --quantize int8 --kv-cache-dtype int8`` over real HTTP and a real live stream (demo model, a
subprocess on 127.0.0.1): the server says how it runs, its answers are the int8 engine's own (the same text as
offline transcription with the same settings) and right, and a live stream through ``qasr stream`` gets the
spoken words."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import jiwer
import pytest
from server_proc import DEMO_MODEL, ROOT, ServerProcess

from qasr.testing.speech import speak

SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "turn off the lights")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("int8_server_audio")
    return {s: speak(s, d / f"s{k}.wav") for k, s in enumerate(SENTENCES)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("int8_server") / "serve.log", "--quantize", "int8",
                      "--kv-cache-dtype", "int8") as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(clips) -> dict[str, str]:
    from qasr import ASR
    from qasr.engine.config import EngineConfig

    asr = ASR.from_pretrained(DEMO_MODEL, device="cpu", dtype="float32", quantize="int8",
                              engine=EngineConfig(kv_cache_dtype="int8"))
    try:
        return {s: r.text for s, r in zip(clips, asr.transcribe([str(p) for p in clips.values()]), strict=True)}
    finally:
        asr.close()


def test_the_model_entry_says_int8(server) -> None:
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    for model in models:
        assert model["quantize"] == "int8" and model["kv_cache_dtype"] == "int8"
        assert model["kernels"].startswith("int8 W8A8 dynamic linears and encoder convs")


def test_answers_are_the_int8_engines_and_right(server, clips, offline) -> None:
    for sentence, path in clips.items():
        with open(path, "rb") as f:
            r = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": (path.name, f, "audio/wav")},
                           data={"model": "m", "response_format": "json"}, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert text == offline[sentence]  # the same engine settings give the same tokens
        assert jiwer.wer(sentence, jiwer.RemovePunctuation()(text.lower()).strip()) <= 0.2, text


def test_a_live_stream_gets_the_words(server, clips) -> None:
    sentence, path = next(iter(clips.items()))
    done = subprocess.run([sys.executable, "-m", "qasr", "stream", str(path), "--server", server.url], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    heard = re.sub(r"\[[^\]]*\]", " ", done.stdout)  # lines are "[start -> end] text"
    assert jiwer.wer(sentence, " ".join(jiwer.RemovePunctuation()(heard.lower()).split())) <= 0.2, done.stdout
