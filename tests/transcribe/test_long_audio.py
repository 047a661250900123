"""Long recordings through the public API with the demo model: VAD segments, offsets, stitching, modes."""

from __future__ import annotations

from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf
import soxr

from qasr import ASR, TranscribeOptions
from qasr.testing.speech import speak
from qasr.transcribe.text import join_segment_texts

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights", "remind me to buy milk tomorrow", "what is the weather like today")


@pytest.fixture(scope="module")
def asr():
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32")
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def ten_minutes(tmp_path_factory) -> tuple[np.ndarray, list[tuple[float, float]], str]:
    """About 10 minutes: sentences with 0.4-6 s pauses, quiet noise between some, and a 40 s silence.
    Returns the waveform, the true speech spans (seconds) and the spoken text."""
    d = tmp_path_factory.mktemp("long")
    rng = np.random.default_rng(7)
    voices = (("en-us", 160), ("en-gb", 150), ("en-us+f3", 170))
    parts, spans, words, t = [], [], [], 0.0
    k = 0
    while t < 600:
        if k == 20:  # one long silence in the middle
            parts.append(np.zeros(40 * SR, np.float32))
            t += 40
        sentence = SENTENCES[k % len(SENTENCES)]
        voice, speed = voices[k % len(voices)]
        wave, sr = sf.read(speak(sentence, d / "s.wav", voice=voice, speed=speed), dtype="float32")
        wave = soxr.resample(wave, sr, SR).astype(np.float32)
        loud = np.flatnonzero(np.abs(wave) > 0.02)  # espeak pads its own silence: the truth is the voiced part
        spans.append((t + loud[0] / SR, t + loud[-1] / SR))
        words.append(sentence)
        gap = np.zeros(int(SR * rng.uniform(0.4, 6.0)), np.float32)
        if k % 4 == 3:
            gap += (0.003 * rng.standard_normal(len(gap))).astype(np.float32)
        parts += [wave, gap]
        t += (len(wave) + len(gap)) / SR
        k += 1
    return np.concatenate(parts), spans, " ".join(words)


def test_ten_minutes_in_vad_segments(asr, ten_minutes) -> None:
    wave, spans, truth = ten_minutes
    [r] = asr.transcribe((wave, SR), TranscribeOptions(max_segment_s=30))  # auto: longer than 30 s, so VAD segments
    assert r.ok and r.duration == pytest.approx(len(wave) / SR, abs=1e-3)
    segs = r.segments
    assert len(segs) >= (len(wave) / SR - 40) / 30  # 30 s at most each, the silence skipped
    for a, b in zip(segs, segs[1:], strict=False):
        assert a.start < a.end <= b.start  # in order, never overlapping
    assert all(s.end - s.start <= 30.0 + 1e-6 for s in segs)
    for lo, hi in spans:  # every stretch of speech lies inside one segment (0.1 s tolerance at the edges)
        assert any(s.start <= lo + 0.1 and hi - 0.1 <= s.end for s in segs), (lo, hi)
    quiet = (spans[19][1] + 1, spans[20][0] - 1)  # the 40 s of silence
    assert not any(quiet[0] < s.start < s.end < quiet[1] for s in segs), "a segment inside the silence"
    assert r.text == join_segment_texts(s.text for s in segs)
    assert "  " not in r.text and r.text == r.text.strip()
    assert all(s.text for s in segs)  # every segment holds speech, so every one has words


# The bundled demo model gives WER 0.063 here (2.2% on validation 21-28 s segments); the target is 0.25.
def test_ten_minutes_are_recognised(asr, ten_minutes) -> None:
    wave, _, truth = ten_minutes
    [r] = asr.transcribe((wave, SR))
    assert jiwer.wer(truth, r.text) < 0.25


def test_fixed_and_none_modes(asr, ten_minutes) -> None:
    wave, _, _ = ten_minutes
    head = wave[: 95 * SR]
    # 30 s given: the official package's length (the demo model declares 6 s, docs/segmentation.md)
    [fixed] = asr.transcribe((head, SR), TranscribeOptions(segmentation="fixed", max_segment_s=30), max_new_tokens=3)
    assert [(s.start, s.end) for s in fixed.segments] == [(0.0, 30.0), (30.0, 60.0), (60.0, 90.0), (90.0, 95.0)]
    [whole] = asr.transcribe((head, SR), TranscribeOptions(segmentation="none"), max_new_tokens=3)
    assert [(s.start, s.end) for s in whole.segments] == [(0.0, 95.0)]
    # auto: up to 30 s whole
    [short] = asr.transcribe((head[: 20 * SR], SR), TranscribeOptions(max_segment_s=30), max_new_tokens=3)
    assert [(s.start, s.end) for s in short.segments] == [(0.0, 20.0)]
    with pytest.raises(ValueError, match="segmentation"):
        asr.transcribe((head, SR), TranscribeOptions(segmentation="smart"))


def test_silence_gives_an_empty_transcript(asr) -> None:
    [r] = asr.transcribe((np.zeros(45 * SR, np.float32), SR))
    assert r.ok and r.text == "" and r.segments == () and r.duration == pytest.approx(45.0)
