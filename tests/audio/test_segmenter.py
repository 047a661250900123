"""Segmentation of long audio: speech + long pauses + noise, online and at once."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.audio.io import SAMPLE_RATE, load_audio
from qasr.audio.segments import AudioSegment, Segmenter, segment_audio
from qasr.audio.split import split_long_audio
from qasr.audio.vad import VadConfig
from qasr.testing.speech import speak

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def long_mix(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """~10 minutes: speech runs (some over 30 s), long pauses, stretches of noise; plus speech spans."""
    d = tmp_path_factory.mktemp("seg")
    text = "Long recordings are cut into pieces the model can read, at the pauses between sentences."
    clip = load_audio(speak(text, d / "s.wav"))
    rng = np.random.default_rng(0)
    parts, speech, pos = [], [], 0
    while pos < 600 * SR:
        run = np.tile(clip, int(rng.integers(1, 8)))  # up to ~40 s of continuous talk
        parts.append(run)
        speech.append((pos, pos + run.size))
        pos += run.size
        pause = (rng.standard_normal(int(rng.uniform(0.5, 40) * SR)) * 0.003).astype(np.float32)
        parts.append(pause)
        pos += pause.size
    return np.concatenate(parts), speech


def _same(a: list[AudioSegment], b: list[AudioSegment]) -> bool:
    return len(a) == len(b) and all(
        (x.start, x.end) == (y.start, y.end) and np.array_equal(x.samples, y.samples)
        for x, y in zip(a, b, strict=True)
    )


def _feed_randomly(segmenter: Segmenter, wave: np.ndarray, seed: int) -> tuple[list[AudioSegment], int]:
    rng, out, pos, held = np.random.default_rng(seed), [], 0, 0
    while pos < wave.size:
        n = int(rng.integers(1, 3 * SR))
        out += segmenter.feed(wave[pos : pos + n])
        pos += n
        held = max(held, segmenter.held_samples)
    return out + segmenter.flush(), held


def test_vad_segments_of_long_mix(long_mix) -> None:
    wave, speech = long_mix
    segs = segment_audio(wave, "vad", 30.0)
    starts = [s.start for s in segs]
    assert starts == sorted(starts) and all(a.end <= b.start for a, b in zip(segs, segs[1:], strict=False))
    assert all(s.end - s.start <= 30.0 + 1e-9 for s in segs)
    assert all(np.array_equal(s.samples, wave[s.start_sample : s.start_sample + s.samples.size]) for s in segs)
    covered = np.zeros(wave.size, bool)
    for s in segs:
        covered[s.start_sample : s.start_sample + s.samples.size] = True
    loud = np.abs(wave) > 0.05  # the noise is at 0.003: every loud sample is speech
    edge = SR // 10  # the VAD works in 32 ms frames and may clip the very onset of a word after noise
    for lo, hi in speech:
        loud[lo : lo + edge] = loud[hi - edge : hi] = False
    assert covered[loud].all()  # all speech is in some segment
    assert all(covered[lo:hi].mean() > 0.7 for lo, hi in speech)
    assert covered.mean() < 0.9  # the pauses are mostly left out


@pytest.mark.parametrize("mode", ["vad", "fixed", "none"])
def test_online_equals_at_once(long_mix, mode: str) -> None:
    wave, _ = long_mix
    vad = VadConfig(backend="energy") if mode != "vad" else VadConfig()
    whole = segment_audio(wave, mode, 30.0, vad)
    got, held = _feed_randomly(Segmenter(mode, 30.0, vad), wave, seed=3)
    assert _same(got, whole)
    if mode != "none":
        assert held < 40 * SR  # O(max_s), not the 10 minutes


def test_short_max_segment_and_energy_online(long_mix) -> None:
    wave, _ = long_mix
    wave = wave[: 150 * SR]
    vad = VadConfig(backend="energy")
    whole = segment_audio(wave, "vad", 7.0, vad)
    assert all(s.end - s.start <= 7.0 + 1e-9 for s in whole)
    assert _same(_feed_randomly(Segmenter("vad", 7.0, vad), wave, seed=5)[0], whole)


def test_fixed_windows_tile_input() -> None:
    wave = np.random.default_rng(2).uniform(-0.5, 0.5, 65 * SR + 123).astype(np.float32)
    segs = segment_audio(wave, "fixed", 30.0)
    assert [(s.start, s.end) for s in segs] == [(0.0, 30.0), (30.0, 60.0), (60.0, (65 * SR + 123) / SR)]
    assert np.array_equal(np.concatenate([s.samples for s in segs]), wave)


def test_none_mode_matches_split_long_audio() -> None:
    rng = np.random.default_rng(4)
    wave = (rng.standard_normal(1250 * SR) * 0.1).astype(np.float32)
    wave[1198 * SR : 1198 * SR + 3200] = 0.0  # a quiet spot for the cut to find
    pieces = split_long_audio(wave)
    segs = segment_audio(wave, "none")
    assert [s.start for s in segs] == [p.offset_sec for p in pieces] and len(segs) == 2
    assert all(np.array_equal(s.samples, p.samples) for s, p in zip(segs, pieces, strict=True))
    assert _same(_feed_randomly(Segmenter("none"), wave, seed=1)[0], segs)
    short = segment_audio(wave[: 10 * SR], "none")
    assert len(short) == 1 and short[0].end == 10.0


def test_silence_only_gives_no_segments() -> None:
    quiet = (np.random.default_rng(6).standard_normal(60 * SR) * 1e-4).astype(np.float32)
    assert segment_audio(quiet, "vad") == []
    assert segment_audio(np.zeros(60 * SR, np.float32), "vad", vad=VadConfig(backend="energy")) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Segmenter("words")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Segmenter("vad", max_s=0.2)
