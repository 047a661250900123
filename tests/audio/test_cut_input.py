"""Streaming decode: segments equal load_audio's samples, for every input kind, in bounded memory."""

from __future__ import annotations

import logging
import subprocess
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import noise

from qasr.audio import vad
from qasr.audio.cutting import cut_input, iter_segments
from qasr.audio.io import SAMPLE_RATE, AudioError, load_audio
from qasr.audio.vad import VadConfig
from qasr.testing.speech import convert, speak

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stream")
    text = "Streaming decoding hands out segments while the rest of the file is still unread. " * 2
    return speak(text, d / "speech.wav")


def _assert_matches(segments, ref: np.ndarray) -> None:
    assert segments
    for s in segments:
        assert np.array_equal(s.samples, ref[s.start_sample : s.start_sample + s.samples.size])


@pytest.mark.parametrize("ext", [".wav", ".flac", ".mp3", ".m4a"])
@pytest.mark.parametrize("mode", ["fixed", "vad"])
def test_stream_equals_load_audio(speech_wav: Path, ext: str, mode: str) -> None:
    path = speech_wav if ext == ".wav" else convert(speech_wav, speech_wav.with_suffix(ext))
    ref = load_audio(path)
    stream = iter_segments(path, mode=mode, max_s=4.0, block_s=0.7)
    assert stream.duration is not None and abs(stream.duration - ref.size / SR) < 0.1  # probed
    segments = list(stream)
    _assert_matches(segments, ref)
    assert stream.duration == ref.size / SR  # exact once exhausted
    if mode == "fixed":
        assert sum(s.samples.size for s in segments) == ref.size


def test_loud_resampled_float_input_is_normalised(speech_wav: Path) -> None:
    """A 44.1 kHz stereo float file above full scale: the two-pass peak rule matches load_audio."""
    loud = speech_wav.with_name("loud.wav")
    subprocess.run(["ffmpeg", "-y", "-loglevel", "error", "-i", str(speech_wav), "-af", "volume=12dB",
                    "-ar", "44100", "-ac", "2", "-c:a", "pcm_f32le", str(loud)], check=True)
    ref = load_audio(loud)
    _assert_matches(list(iter_segments(loud, mode="fixed", max_s=3.0, block_s=0.5)), ref)
    assert np.abs(ref).max() == 1.0


def test_bytes_arrays_and_tuples(speech_wav: Path) -> None:
    mp3 = convert(speech_wav, speech_wav.with_name("b.mp3")).read_bytes()
    _assert_matches(list(iter_segments(mp3, mode="fixed", max_s=3.0)), load_audio(mp3))
    wave, sr = sf.read(speech_wav, dtype="int16")
    ref = load_audio(wave, sr)
    _assert_matches(list(iter_segments(wave, sample_rate=sr, mode="fixed", max_s=3.0)), ref)
    stream = iter_segments((wave, sr), mode="vad", block_s=0.3)
    assert stream.duration == ref.size / SR
    _assert_matches(list(stream), ref)


def test_errors_name_the_input(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="missing.wav: file not found"):
        iter_segments(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="is a directory"):
        iter_segments(tmp_path)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all" * 100)
    with pytest.raises(AudioError, match="bad.wav: cannot be decoded as audio"):
        iter_segments(bad)
    with pytest.raises(AudioError, match="bytes input"):
        iter_segments(b"")
    with pytest.raises(AudioError, match="sample_rate is required"):
        iter_segments(np.zeros(100, np.float32))


def test_silent_file_gives_no_segments(tmp_path: Path) -> None:
    path = tmp_path / "silence.flac"
    sf.write(path, np.zeros(20 * SR, np.int16), SR)
    stream = iter_segments(path)
    assert list(stream) == [] and stream.duration == 20.0


def test_long_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    """30 minutes of 16 kHz audio (115 MB as float32) stream with a few MB of Python allocations."""
    path = tmp_path / "long.wav"
    rng = np.random.default_rng(0)
    word = (np.sin(np.arange(SR // 2) * 0.2) * 0.5 * 32767).astype(np.int16)  # a 0.5 s "word"
    with sf.SoundFile(path, "w", SR, 1, "PCM_16") as f:
        for _ in range(30 * 60 // 10):  # 10 s blocks: 6 s of words, 4 s of quiet
            block = (rng.standard_normal(10 * SR) * 30).astype(np.int16)
            for k in range(6):
                block[k * SR : k * SR + word.size] += word
            f.write(block)
    waveform_bytes = 30 * 60 * SR * 4
    tracemalloc.start()
    try:
        stream = iter_segments(path, mode="vad", vad=VadConfig(backend="energy"), block_s=5.0)
        count, last = 0, 0.0
        for seg in stream:
            assert seg.start >= last and seg.end - seg.start <= 30.0
            last, count = seg.end, count + 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stream.duration == 1800.0 and count > 50
    assert peak < waveform_bytes / 10, f"peak {peak / 1e6:.1f} MB"


def test_the_fallback_vad_warns_only_when_the_vad_runs(speech_wav: Path, tmp_path: Path, monkeypatch,
                                                       caplog) -> None:
    """No silero-vad: an input "auto" keeps whole says nothing; the first that needs the VAD warns, once."""
    monkeypatch.setattr(vad, "silero_available", lambda: False)
    monkeypatch.setattr(vad, "_warned_fallback", False)
    short = tmp_path / "short.wav"
    sf.write(short, noise(2.4), SR)
    with caplog.at_level(logging.WARNING, logger="qasr"):
        for source in (str(short), (noise(2.4), SR)):
            assert cut_input(source, segmentation="auto", max_s=5.0).segments is None
        assert not caplog.records
        for _ in range(2):
            cut = cut_input(speech_wav, segmentation="auto", max_s=5.0)
            assert cut.segments is not None and cut.segments.vad_backend == "energy" and list(cut.segments)
    assert [r.getMessage() for r in caplog.records] == [
        "silero-vad is not installed: speech detection uses the energy-based fallback VAD"]
