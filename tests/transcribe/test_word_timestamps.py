"""transcribe(..., timestamps="word"): the demo ASR model's text aligned by a (random) forced aligner.

A random aligner's times are meaningless but follow every rule the pipeline promises (inside their
segment, in order, one per word of the text, spelled as the text); the fallbacks are tested too. The
aligner's own exactness is tested against transformers in test_aligner*.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from qasr import ASR, Aligner
from qasr.align.spelling import display_words
from qasr.outputs.writers import render
from qasr.results import Word
from qasr.testing.checkpoint import make_tiny_aligner_checkpoint
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
SR = 16000


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    path = make_tiny_aligner_checkpoint(tmp_path_factory.mktemp("aligner") / "tiny", seed=1)
    aligner = Aligner.from_pretrained(path, device="cpu", dtype="float32")
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32", aligner=aligner)
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    d = tmp_path_factory.mktemp("words")
    parts = []
    for sentence in ("set an alarm for six forty five", "call anna on the ninth of july"):
        wave, sr = sf.read(speak(sentence, d / "s.wav"), dtype="float32")
        parts += [soxr.resample(wave, sr, SR).astype(np.float32), np.zeros(SR * 2, np.float32)]
    return np.concatenate(parts * 8)  # about 50 s: several VAD segments


def test_words_fill_every_segment(asr, speech) -> None:
    [r] = asr.transcribe((speech, SR), timestamps="word")
    assert r.ok and r.timestamps == "word" and len(r.segments) > 1
    for seg in r.segments:
        assert [w.text for w in seg.words] == seg.text.split()
        for w in seg.words:
            assert seg.start <= w.start <= w.end <= seg.end + 1e-3
        starts = [w.start for w in seg.words]
        assert starts == sorted(starts)
    data = json.loads(render(r, "json"))
    assert data["timestamps"] == "word" and data["segments"][0]["words"][0]["text"] == r.segments[0].words[0].text
    plain = asr.transcribe((speech, SR))[0]
    assert plain.text == r.text and plain.timestamps == "segment" and not any(s.words for s in plain.segments)


def test_word_mode_falls_back_with_a_warning(asr, speech, caplog) -> None:
    bare = ASR(asr._core.checkpoint)  # no aligner
    try:
        with caplog.at_level(logging.WARNING, logger="qasr"):
            [r] = bare.transcribe((speech[: SR * 5], SR), timestamps="word")
    finally:
        bare.close()
    assert r.ok and r.timestamps == "segment" and not r.segments[0].words
    assert any("need a forced aligner" in rec.getMessage() for rec in caplog.records)
    with pytest.raises(ValueError, match="timestamps"):
        asr.transcribe((speech[: SR * 5], SR), timestamps="char")


def test_a_language_the_aligner_lacks_keeps_segment_times(asr, speech, caplog, monkeypatch) -> None:
    monkeypatch.setattr(asr._core.aligner, "supported_languages", ("Chinese",))
    with caplog.at_level(logging.WARNING, logger="qasr"):
        [r] = asr.transcribe((speech[: SR * 5], SR), timestamps="word")
    assert r.ok and r.text and r.timestamps == "segment" and not r.segments[0].words
    assert any("not supported by the forced aligner" in rec.getMessage() for rec in caplog.records)


def test_display_words_keep_the_transcripts_spelling() -> None:
    units = [Word("Hello", 0.1, 0.4), Word("world", 0.5, 0.9), Word("it's", 1.0, 1.2), Word("ok", 1.3, 1.5)]
    assert display_words("Hello, world! - it's ok.", units) == (
        Word("Hello,", 0.1, 0.4), Word("world! -", 0.5, 0.9), Word("it's", 1.0, 1.2), Word("ok.", 1.3, 1.5))
    cjk = [Word("你", 0.0, 0.1), Word("好", 0.1, 0.2), Word("世", 0.3, 0.4), Word("界", 0.4, 0.5)]
    assert [w.text for w in display_words("「你好，世界。」", cjk)] == ["「你", "好，", "世", "界。」"]
    mixed = [Word("用", 0.0, 0.1), Word("qasr", 0.1, 0.5), Word("吧", 0.5, 0.6)]
    assert [w.text for w in display_words("用qasr吧！", mixed)] == ["用", "qasr", "吧！"]
    odd = [Word("x", 0.0, 1.0)]
    assert display_words("something else", odd) == tuple(odd)  # units that do not match: left as they are


def test_cli_word_timestamps_make_word_cues(asr, speech, tmp_path) -> None:
    import subprocess
    import sys

    import srt

    clip = tmp_path / "talk.wav"
    sf.write(clip, speech[: SR * 20], SR)
    demo = str(ROOT / "models" / "qasr-demo-en")
    out = subprocess.run([sys.executable, "-m", "qasr", "transcribe", str(clip), "-m", demo,
                          "--aligner", str(asr._core.aligner.checkpoint.path), "--timestamps", "word", "-f", "json,srt",
                          "-o", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32", "--no-progress"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "out" / "talk.json").read_text())
    assert data["timestamps"] == "word"
    words = [w for seg in data["segments"] for w in seg["words"]]
    assert [w["text"] for w in words] == data["text"].split()
    cues = list(srt.parse((tmp_path / "out" / "talk.srt").read_text()))
    starts = {round(w["start"], 3) for w in words}
    ends = {round(w["end"], 3) for w in words}
    for cue in cues:  # every cue begins at a word's start and ends at a word's end
        assert round(cue.start.total_seconds(), 3) in starts and round(cue.end.total_seconds(), 3) in ends
    assert " ".join(" ".join(c.content.split()) for c in cues) == data["text"]


def test_word_chaining_never_holds_up_the_engine(asr, speech, monkeypatch) -> None:
    """A slow word split (nagisa's first import takes seconds) runs off the engine's thread: the engine keeps
    stepping another request meanwhile."""
    import threading
    import time

    from qasr.align import aligner as aligner_module
    from qasr.engine.request import RequestSpec
    from qasr.transcribe.options import TranscribeOptions

    core = asr._core
    split = aligner_module.split_units
    seen: list[tuple[str, int, int]] = []

    def slow_split(text: str, language: str | None = None) -> list[str]:
        before = core.engine.steps
        time.sleep(0.5)
        seen.append((threading.current_thread().name, before, core.engine.steps))
        return split(text, language)

    monkeypatch.setattr(aligner_module, "split_units", slow_split)
    [short, long] = core.prepare([(speech[: SR * 3], SR), (speech[: SR * 8], SR)],
                                 TranscribeOptions(language="English", segmentation="none"))
    other = core.engine.submit(RequestSpec(long.prompt, 2000, waveform=long.samples, ignore_eos=True))
    worded = core.submit(short, words=True)
    result = worded.result(timeout=120)
    assert result.words and not other.done()  # the other request ran all along
    [(thread, before, after)] = seen
    assert thread.startswith("qasr-words")
    assert after > before, "the engine stood still while the words were split"
    other.cancel()


def test_a_piece_cancelled_while_waiting_for_the_word_chain_is_never_aligned(asr, speech, monkeypatch) -> None:
    import threading

    from qasr.align import aligner as aligner_module
    from qasr.transcribe.options import TranscribeOptions

    core = asr._core
    split, release, busy = aligner_module.split_units, threading.Event(), threading.Event()
    aligned: list[str] = []

    def held_split(text: str, language: str | None = None) -> list[str]:
        aligned.append(text)
        busy.set()
        assert release.wait(60)
        return split(text, language)

    monkeypatch.setattr(aligner_module, "split_units", held_split)
    engine_submit, transcribed = core.engine.submit, []
    monkeypatch.setattr(core.engine, "submit", lambda *a, **k: transcribed.append(engine_submit(*a, **k))
                        or transcribed[-1])
    [first, second] = core.prepare([(speech[: SR * 3], SR), (speech[: SR * 3], SR)],
                                   TranscribeOptions(language="English", segmentation="none"))
    a = core.submit(first, words=True)
    assert busy.wait(60)  # the chain's thread is held in the first piece's split
    b = core.submit(second, words=True)
    transcribed[1].result(timeout=60)  # its words wait for the chain's thread
    assert b.cancel()
    release.set()
    assert a.result(timeout=60).words
    assert len(aligned) == 1  # the cancelled piece was dropped, not split and aligned
