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
from qasr.testing.word_runs import FIRST_SEED, speak_runs_by, speak_word_runs, word_runs

ROOT = Path(__file__).resolve().parents[2]
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
    # several inputs: each line starts with its input's path
    assert [line.split(": ", 1)[0] for line in lines] == [str(c) for c in clips]
    texts = [line.split(": ", 1)[1] if ": " in line else "" for line in lines]
    assert wer(texts[:-1]) <= 0.10, list(zip(SENTENCES, texts, strict=False))
    assert texts[-1].strip() == ""


# ---- inputs beyond single sentences: random word runs, a whole 30 s segment, long non-speech ----------

def _joined(paths: list[Path], pause_s: float, out: Path) -> Path:
    """Concatenate WAV files (same rate) with ``pause_s`` of silence between and around them."""
    waves, rate = zip(*(sf.read(p, dtype="float32") for p in paths), strict=True)
    gap = np.zeros(int(pause_s * rate[0]), np.float32)
    sf.write(out, np.concatenate([gap, *(x for w in waves for x in (w, gap))]), rate[0])
    return out


# Runs without a sentence to lean on, by voices and at speeds the model never trained on: 1.7% WER on 80 such
# runs by scripts/eval_word_runs.py, 7.2% on the validation runs of 2-27 s (the model before, which had never
# heard one of these accents: 20% here). Three seeds, not one: 8 runs are too few to tell a margin from luck.
def test_random_word_runs_by_unseen_voices(asr: ASR, tmp_path: Path) -> None:
    runs = [text for seed in range(FIRST_SEED, FIRST_SEED + 3) for text in word_runs(seed)]
    hyps = [" ".join(r.text.lower().split()) for r in asr.transcribe(speak_word_runs(runs, tmp_path))]
    assert jiwer.wer(runs, hyps) <= 0.10, list(zip(runs, hyps, strict=True))


# Voices a user might pick that are far from most of the training data: a whispered variant, a fast unseen
# variant, the accent the model once missed. Measured 1.4%, 5.8% and 1.0% on 32 runs each.
def test_random_word_runs_by_voices_a_user_picks(asr: ASR, tmp_path: Path) -> None:
    voices = (("en-gb-scotland+whisper", 160), ("en-us+f5", 260), ("en-gb-x-gbcwmd", 175))
    runs, paths = [], []
    for k, (voice, wpm) in enumerate(voices):
        by_voice = word_runs(FIRST_SEED + k)
        runs += by_voice
        paths += speak_runs_by(by_voice, voice, wpm, tmp_path)
    hyps = [" ".join(r.text.lower().split()) for r in asr.transcribe(paths)]
    assert jiwer.wer(runs, hyps) <= 0.10, list(zip(runs, hyps, strict=True))


# A segment as the segmenter cuts them (25-30 s, several sentences) comes back whole: the bundled model
# was fine-tuned on such segments (2.2% WER on validation 21-28 s segments, 38 of 40 with >= 90% of their
# words).
def test_thirty_second_segment_is_transcribed_whole(asr: ASR, tmp_path: Path) -> None:
    parts = [speak(t, tmp_path / f"p{i}.wav", voice="en-us-nyc+m7", speed=150, pitch=50)
             for i, t in enumerate(SENTENCES)]
    clip = _joined(parts, 0.7, tmp_path / "segment.wav")
    duration = sf.info(clip).duration
    assert 25 <= duration <= 30, duration  # one segment as the application cuts them
    result = asr.transcribe([clip])[0]
    ref = " ".join(SENTENCES)
    # The bar of the single-sentence tests: the same words are no harder in one segment. Stopping after
    # any one sentence loses at least 7 of the 60 words (> 10%), so a cut-short transcript fails.
    assert jiwer.wer(ref, " ".join(result.text.lower().split())) <= 0.10, result.text
    assert result.finish_reason == "stop", result.finish_reason


@pytest.mark.parametrize("kind", ["silence", "white noise"])
def test_thirty_seconds_without_speech_give_empty_text(asr: ASR, kind: str) -> None:
    rng = np.random.default_rng(3)
    level = 1e-4 if kind == "silence" else 0.05  # a quiet room's floor; loud hiss (-26 dBFS)
    wave = (rng.standard_normal(30 * 16000) * level).astype(np.float32)
    result = asr.transcribe([(wave, 16000)])[0]
    assert result.text == "", result.raw
