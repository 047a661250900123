"""Speech detection on real espeak-ng speech with silences inserted at known places."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.audio.io import SAMPLE_RATE, load_audio
from qasr.audio.vad import SpeechDetector, VadConfig, speech_regions
from qasr.audio.vad_models import silero_available
from qasr.testing.speech import speak

SR = SAMPLE_RATE
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speech recognition turns spoken words into text.",
    "Silence between sentences should be found by the detector.",
]
GAPS_S = [1.5, 2.0]


def _trim(x: np.ndarray) -> np.ndarray:
    """Drop espeak's own leading/trailing near-silence, so the truth is where speech really is."""
    loud = np.flatnonzero(np.abs(x) > 0.02)
    return x[loud[0] : loud[-1] + 1]


@pytest.fixture(scope="module")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Speech with silences of known length; returns the waveform and the true speech spans."""
    d = tmp_path_factory.mktemp("vad")
    clips = [_trim(load_audio(speak(text, d / f"s{i}.wav"))) for i, text in enumerate(SENTENCES)]
    parts, truth, pos = [np.zeros(SR, np.float32)], [], SR
    for i, clip in enumerate(clips):
        parts.append(clip)
        truth.append((pos, pos + clip.size))
        pos += clip.size
        pause = np.zeros(int((GAPS_S[i] if i < len(GAPS_S) else 1.0) * SR), np.float32)
        parts.append(pause)
        pos += pause.size
    return np.concatenate(parts), truth


def _check_boundaries(regions: list[tuple[int, int]], truth: list[tuple[int, int]], tol_s: float) -> None:
    tol = tol_s * SR
    # every inserted silence is a gap: some region ends near the speech end, the next starts near the restart
    for (_, end), (start, _) in zip(truth[:-1], truth[1:], strict=True):
        assert min(abs(r[1] - end) for r in regions) <= tol, (end / SR, regions)
        assert min(abs(r[0] - start) for r in regions) <= tol, (start / SR, regions)
        middle = (end + start) // 2
        assert not any(r[0] <= middle < r[1] for r in regions)
    assert abs(regions[0][0] - truth[0][0]) <= tol and abs(regions[-1][1] - truth[-1][1]) <= tol


@pytest.mark.skipif(not silero_available(), reason="silero-vad not installed")
def test_silero_boundaries_within_200ms(spoken) -> None:
    wave, truth = spoken
    detector = SpeechDetector(VadConfig(backend="silero"))
    assert detector.backend.startswith("silero")
    _check_boundaries(speech_regions(wave, VadConfig(backend="silero")), truth, 0.2)


def test_energy_fallback_boundaries(spoken) -> None:
    # Looser: the energy detector also counts breath-like tails and quiet onsets of fricatives as speech
    # and has no notion of voicing, so its edges wander a little further from the truth than silero's.
    wave, truth = spoken
    _check_boundaries(speech_regions(wave, VadConfig(backend="energy")), truth, 0.3)


@pytest.mark.parametrize("backend", ["silero", "energy"])
def test_chunking_does_not_change_regions(spoken, backend: str) -> None:
    if backend == "silero" and not silero_available():
        pytest.skip("silero-vad not installed")
    wave, _ = spoken
    config = VadConfig(backend=backend)
    whole = speech_regions(wave, config)
    rng = np.random.default_rng(0)
    detector, got, pos = SpeechDetector(config), [], 0
    while pos < wave.size:
        n = int(rng.integers(1, 9000))
        got += detector.feed(wave[pos : pos + n])
        pos += n
    assert got + detector.flush() == whole


@pytest.mark.skipif(not silero_available(), reason="silero-vad not installed")
def test_matches_silero_reference_rules(spoken) -> None:
    """Our incremental post-processing equals silero's own get_speech_timestamps_from_probs."""
    ref = pytest.importorskip("silero_vad.utils_vad")
    from qasr.audio.vad_models import FRAME, SileroOnnx

    wave, _ = spoken
    frames = np.zeros(-(-wave.size // FRAME) * FRAME, np.float32)
    frames[: wave.size] = wave
    probs = SileroOnnx().score(frames.reshape(-1, FRAME))
    for pad, silence in [(0.03, 0.1), (0.3, 0.05), (0.0, 0.5)]:
        want = ref.get_speech_timestamps_from_probs(
            list(probs), audio_length_samples=wave.size, speech_pad_ms=pad * 1000,
            min_silence_duration_ms=silence * 1000,
        )
        got = speech_regions(wave, VadConfig(backend="silero", speech_pad_s=pad, min_silence_s=silence))
        assert got == [(w["start"], w["end"]) for w in want]


def test_silence_has_no_regions() -> None:
    quiet = (np.random.default_rng(1).standard_normal(5 * SR) * 1e-4).astype(np.float32)
    for backend in ("auto", "energy"):
        assert speech_regions(np.zeros(5 * SR, np.float32), VadConfig(backend=backend)) == []
        assert speech_regions(quiet, VadConfig(backend=backend)) == []


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        VadConfig(backend="webrtc")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        VadConfig(threshold=1.5)


@pytest.mark.skipif(not silero_available(), reason="silero-vad not installed")
def test_the_vad_session_leaves_torch_threads_alone() -> None:
    """Making the ONNX Runtime session dropped the process's OpenMP thread count to 1, so the engine
    thread started after it (every file transcription with VAD) ran on one core. In a fresh process:
    torch's thread count, and a new thread's, stay what they were."""
    import subprocess
    import sys

    code = """
import threading, torch
torch.set_num_threads(2)
from qasr.audio.vad import SpeechDetector, VadConfig
SpeechDetector(VadConfig(backend="silero")).feed(__import__("numpy").zeros(16000 * 3, "float32"))
seen = []
t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
t.start(); t.join()
print(torch.get_num_threads(), seen[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["2", "2"], out.stdout + out.stderr
