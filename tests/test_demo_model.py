"""End to end with the bundled demo model: real speech in, the right words out, via the API and the CLI.

The other tests run random checkpoints, which prove the numerics but not that anything is recognised.
These speak sentences the model never heard in training (TEST_SENTENCES of scripts/make_demo_data.py,
excluded from its training and validation data) with espeak-ng and check the words.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf

from qasr import ASR
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "qasr-demo-en"
VOICES = (("en-us", 160, 50), ("en-gb", 150, 40), ("en-us+f3", 175, 60), ("en-gb-scotland+m3", 140, 45))


def _test_sentences() -> tuple[str, ...]:
    """TEST_SENTENCES from the data script (one list: the script keeps them out of all its data)."""
    tree = ast.parse((ROOT / "scripts" / "make_demo_data.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TEST_SENTENCES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("scripts/make_demo_data.py has no TEST_SENTENCES")


SENTENCES = _test_sentences()


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("demo")
    out = []
    for i, text in enumerate(SENTENCES):
        voice, speed, pitch = VOICES[i % len(VOICES)]
        out.append(speak(text, d / f"s{i}.wav", voice=voice, speed=speed, pitch=pitch))
    silence = d / "silence.wav"
    sf.write(silence, np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 1e-4, 16000)
    return [*out, silence]


@pytest.fixture(scope="module")
def asr() -> ASR:
    assert (MODEL / "config.json").exists(), f"the demo model is missing: {MODEL}"
    return ASR.from_pretrained(MODEL, device="cpu", dtype="float32")


def wer(hyps: list[str]) -> float:
    return jiwer.wer(list(SENTENCES), [" ".join(h.lower().split()) for h in hyps])


def test_api_recognises_unseen_sentences(asr: ASR, clips: list[Path]) -> None:
    results = asr.transcribe(clips)
    assert all(r.error is None for r in results)
    hyps = [r.text for r in results[:-1]]
    assert wer(hyps) <= 0.10, list(zip(SENTENCES, hyps, strict=True))
    assert all(r.language == "English" for r in results[:-1])
    assert results[-1].text == "", results[-1].raw
    single = [asr.transcribe(c)[0] for c in clips]
    assert [r.text for r in single] == [r.text for r in results]
    assert [r.token_ids for r in single] == [r.token_ids for r in results]


def test_cli_recognises_unseen_sentences(clips: list[Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "qasr.cli", "transcribe", *map(str, clips), "-m", str(MODEL)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(clips), out.stdout
    assert wer(lines[:-1]) <= 0.10, list(zip(SENTENCES, lines, strict=False))
    assert lines[-1].strip() == ""
