"""End to end with the bundled demo aligner: real speech in, the right word times out.

The aligner tests elsewhere run random checkpoints, which prove the numerics but not that anything is
timed. These speak sentences the aligner never heard (ALIGNER_TEST_SENTENCES of
scripts/make_aligner_data.py, kept out of its data) with espeak-ng voices it never heard, take each
word's true start and end from espeak-ng's word events (the way the training data got them), and check
the times ``qasr.Aligner.align`` gives.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import soundfile as sf

from qasr import ASR, Aligner, TranscribeOptions
from qasr.transcribe.words import LEAD_IN_CLASSES, with_lead_in

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "qasr-demo-aligner-en"
# Held-out voices of the data script (accents and variants never trained on), at in-range speeds.
VOICES = (("en-us-nyc+f5", 150, 55), ("en-gb-x-gbcwmd+m7", 170, 40), ("en-us-nyc+m7", 140, 45),
          ("en-gb-x-gbcwmd+f5", 185, 60))
# Bounds on the mean absolute start/end error, about 1.5-2x what the model card reports for such clips
# (single sentences ~26 ms; several sentences with pauses ~50 ms).
SENTENCE_MEAN_S, SENTENCE_WORST_S = 0.05, 0.16
LONG_MEAN_S = 0.10


def _data_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_aligner_data", ROOT / "scripts" / "make_aligner_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def clips() -> list[tuple[np.ndarray, str, list[list]]]:
    """(16 kHz audio, text, [word, start, end]) per clip: each test sentence alone with some silence
    around it, and all four in one clip with pauses, faint noise added."""
    data = _data_script()
    rng = np.random.default_rng(0)
    spoken = [data.speak_words(text, *voice) for text, voice in zip(data.ALIGNER_TEST_SENTENCES, VOICES,
                                                                    strict=True)]
    out = []
    for text, (wave, words) in zip(data.ALIGNER_TEST_SENTENCES, spoken, strict=True):
        out.append(_with_silence([(wave, words)], [text], [0.4], rng))
    out.append(_with_silence(spoken, list(data.ALIGNER_TEST_SENTENCES), [0.7, 1.2, 0.3, 0.9], rng))
    return out


def _with_silence(parts: list[tuple[np.ndarray, list[list]]], texts: list[str], pauses: list[float],
                  rng: np.random.Generator) -> tuple[np.ndarray, str, list[list]]:
    """Parts joined after the pauses (seconds of silence before each part), their word times shifted."""
    pieces, words, t = [], [], 0.0
    for (wave, timed), pause in zip(parts, pauses, strict=True):
        t += pause
        pieces += [np.zeros(int(pause * 16000), np.float32), wave]
        words += [[w, a + t, b + t] for w, a, b in timed]
        t += len(wave) / 16000
    pieces.append(np.zeros(8000, np.float32))
    audio = np.concatenate(pieces)
    audio = 0.5 * audio / np.abs(audio).max() + rng.standard_normal(len(audio)).astype(np.float32) * 3e-3
    return audio.astype(np.float32), " ".join(texts), words


@pytest.fixture(scope="module")
def aligner() -> Iterator[Aligner]:
    assert (MODEL / "config.json").exists(), f"the demo aligner is missing: {MODEL}"
    with Aligner.from_pretrained(MODEL, device="cpu", dtype="float32") as a:
        yield a


def test_checkpoint_is_the_release_aligner_layout(aligner: Aligner) -> None:
    cfg = aligner.checkpoint.config
    assert cfg.is_aligner and cfg.layout == "original"
    assert cfg.timestamp_segment_time == 80 and aligner.max_seconds >= 30
    assert aligner.supported_languages == ("English",)


def _errors(aligner: Aligner, clips: list[tuple[np.ndarray, str, list[list]]]) -> list[float]:
    """Absolute start and end errors (s) of every word, after checking words and order."""
    found = aligner.align([(audio, 16000) for audio, _, _ in clips], [text for _, text, _ in clips], "English")
    errors = []
    for (_, text, truth), words in zip(clips, found, strict=True):
        assert [w.text for w in words] == text.split()
        assert all(a.start <= a.end <= b.start for a, b in zip(words, words[1:], strict=False))
        errors += [abs(w.start - a) for w, (_, a, _) in zip(words, truth, strict=True)]
        errors += [abs(w.end - b) for w, (_, _, b) in zip(words, truth, strict=True)]
    return errors


def test_sentence_word_times_match_espeak(aligner: Aligner, clips: list[tuple[np.ndarray, str, list[list]]]) -> None:
    errors = _errors(aligner, clips[:-1])
    assert np.mean(errors) <= SENTENCE_MEAN_S, f"mean boundary error {np.mean(errors) * 1000:.0f} ms"
    assert max(errors) <= SENTENCE_WORST_S, f"worst boundary error {max(errors) * 1000:.0f} ms"


def test_long_clip_is_roughly_timed(aligner: Aligner, clips: list[tuple[np.ndarray, str, list[list]]]) -> None:
    """Four sentences with pauses in one 12 s clip: timed less precisely than one sentence (see the model card)."""
    errors = _errors(aligner, clips[-1:])
    assert np.mean(errors) <= LONG_MEAN_S, f"mean boundary error {np.mean(errors) * 1000:.0f} ms"


def test_a_segment_cut_at_the_speech_onset_is_timed(aligner: Aligner) -> None:
    """The bundled example's first VAD segment starts 10 ms before its first word. transcribe gives the
    aligner a lead-in of silence (qasr.transcribe.words.with_lead_in); without it the demo aligner put "of july"
    into the pause after its sentence and "turn" a second early. Its pauses are digital silence, so a word
    start placed in one is plain to see: every word must start within 0.12 s of sound."""
    clip = ROOT / "examples" / "briefing.flac"
    wave, sr = sf.read(clip, dtype="float32")
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32", aligner=aligner)
    try:
        # 30 s segments: the first then holds four sentences and their pauses (the demo model's own 6 s would
        # cut at the pauses and leave the aligner nothing to misplace)
        [r] = asr.transcribe(clip, TranscribeOptions(max_segment_s=30), timestamps="word")
    finally:
        asr.close()
    first = r.segments[0]
    assert first.start < 0.1 and len(first.words) == len(first.text.split()) == 28, first
    silent = [w for w in first.words if np.abs(wave[int(w.start * sr):int((w.start + 0.12) * sr)]).max() < 1e-3]
    assert not silent, silent


def test_lead_in_keeps_the_class_grid_and_the_aligner_limit(aligner: Aligner) -> None:
    samples = np.ones(16000, np.float32)
    padded, lead = with_lead_in(samples, aligner)
    assert lead == pytest.approx(LEAD_IN_CLASSES * aligner.segment_ms / 1000) and lead * 1000 % aligner.segment_ms == 0
    assert len(padded) == 16000 + round(lead * 16000) and not padded[:round(lead * 16000)].any()
    assert np.array_equal(padded[round(lead * 16000):], samples)
    longest = np.ones(int(aligner.max_seconds * 16000), np.float32)  # no room for a lead-in: unchanged
    same, none = with_lead_in(longest, aligner)
    assert none == 0.0 and same is longest
