"""A long input's segments as they happen (ASR.transcribe_segments, transcribe_iter(segments=True)): in time
order, each as soon as it and every one before it are done, the same segments and text as ``transcribe``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from conftest import record_log_mel_and_submits

from qasr import ASR, Segment, TranscribeOptions, Transcription, TranscriptionFailed
from qasr.engine.config import EngineConfig
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights", "remind me to buy milk tomorrow", "what is the weather like today")
RUNNING = 2  # requests decoded at once: a long input's segments then finish in waves, as at scale


@pytest.fixture(scope="module")
def asr():
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32",
                              engine=EngineConfig(max_running=RUNNING))
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def long_wave(tmp_path_factory) -> np.ndarray:
    """About 70 s: 16 sentences with 1 s pauses (segments of at most 4 s: about one per sentence)."""
    d = tmp_path_factory.mktemp("in_order")
    parts = []
    for k in range(16):
        wave, sr = sf.read(speak(SENTENCES[k % len(SENTENCES)], d / "s.wav", speed=150 + 5 * k), dtype="float32")
        parts += [soxr.resample(wave, sr, SR).astype(np.float32), np.zeros(SR, np.float32)]
    return np.concatenate(parts)


def test_segments_arrive_in_order_long_before_the_input_ends(asr, long_wave) -> None:
    whole = asr.transcribe((long_wave, SR), TranscribeOptions(segmentation="vad", max_segment_s=4))[0]
    assert len(whole.segments) >= 10
    stream = asr.transcribe_segments((long_wave, SR), TranscribeOptions(segmentation="vad", max_segment_s=4))
    steps_before = asr._core.engine.steps
    got: list[tuple[Segment, int]] = []
    for segment in stream:
        got.append((segment, asr._core.engine.steps - steps_before))  # engine steps run when it was handed over
    total = asr._core.engine.steps - steps_before
    segments = [s for s, _ in got]
    assert segments == list(whole.segments)  # the same segments, in time order
    assert [s.start for s in segments] == sorted(s.start for s in segments)
    assert stream.transcription == whole and stream.transcription.text == whole.text
    # the first segment came while most of the input's work was still to do (counted in steps, not seconds)
    first_at = got[0][1]
    assert first_at < total / 3, (first_at, total, [at for _, at in got])
    assert [at for _, at in got] == sorted(at for _, at in got)


def test_transcribe_iter_gives_each_inputs_segments_then_its_result(asr, long_wave) -> None:
    short = long_wave[: 4 * SR]
    seen: dict[int, list[Segment]] = {0: [], 1: []}
    results: dict[int, Transcription] = {}
    vad = TranscribeOptions(segmentation="vad", max_segment_s=4)
    for i, item in asr.transcribe_iter([(long_wave, SR), (short, SR)], vad, segments=True):
        assert i not in results, "a segment came after its input's Transcription"
        if isinstance(item, Segment):
            seen[i].append(item)
        else:
            results[i] = item
    for i in (0, 1):
        assert tuple(seen[i]) == results[i].segments and results[i].error is None


def test_only_a_streamed_calls_first_piece_leads(asr, long_wave, monkeypatch) -> None:
    """Streamed segments: the call's first piece is its group's lead (its text starts early); a call whose
    results come whole has no lead, so its pieces share the engine as before."""
    _, specs = record_log_mel_and_submits(asr._core, monkeypatch)
    vad = TranscribeOptions(segmentation="vad", max_segment_s=4)
    list(asr.transcribe_segments((long_wave, SR), vad))
    assert len(specs) >= 10 and [s.lead for s in specs] == [True] + [False] * (len(specs) - 1)
    specs.clear()
    asr.transcribe([(long_wave, SR), (long_wave[: 4 * SR], SR)], vad)
    assert len(specs) >= 10 and not any(s.lead for s in specs)


def test_a_failed_input_raises_after_its_segments(asr, tmp_path) -> None:
    bad = tmp_path / "not_audio.wav"
    bad.write_bytes(b"this is not a wave file at all")
    stream = asr.transcribe_segments(str(bad))
    with pytest.raises(TranscriptionFailed, match="not_audio.wav") as failed:
        list(stream)
    assert failed.value.transcription.error and stream.transcription is failed.value.transcription
    with pytest.raises(ValueError, match="one input"):
        asr.transcribe_segments([str(bad), str(bad)])


def test_stopping_early_cancels_the_rest(asr, long_wave) -> None:
    with asr.transcribe_segments((long_wave, SR), TranscribeOptions(segmentation="vad", max_segment_s=4)) as stream:
        first = next(iter(stream))
    assert first.text
    deadline = time.monotonic() + 10
    while (stats := asr._core.engine.stats()).running or stats.waiting:  # the rest was cancelled, not finished
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
