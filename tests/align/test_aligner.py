"""qasr.Aligner's interface: inputs, broadcasting, limits and errors; the engine's alignment requests."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import noise

import qasr
from qasr.align.aligner import Aligner
from qasr.engine.engine import Engine, RequestSpec
from qasr.model.checkpoint import load_checkpoint
from qasr.results import Word
from qasr.testing import make_tiny_aligner_checkpoint

CLASSES = 250  # 250 x 80 ms: a 20 s limit, to test it cheaply


@pytest.fixture(scope="module")
def aligner(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_aligner_checkpoint(tmp_path_factory.mktemp("aligner_api"), classify_num=CLASSES)
    with Aligner.from_pretrained(path, device="cpu", dtype="float32") as a:
        yield a


def test_lazy_export() -> None:
    assert qasr.Aligner is Aligner


def test_properties(aligner: Aligner) -> None:
    assert aligner.max_seconds == pytest.approx(20.0)
    assert aligner.supported_languages[:3] == ("Chinese", "English", "Cantonese")
    assert len(aligner.supported_languages) == 11


def test_single_and_batched_calls(aligner: Aligner) -> None:
    a, b = noise(2.0, seed=1), noise(4.5, seed=2)
    one = aligner.align((a, 16000), "hello there, world", "en")
    assert len(one) == 1 and [w.text for w in one[0]] == ["hello", "there", "world"]
    assert all(isinstance(w, Word) and 0.0 <= w.start <= w.end for w in one[0])
    both = aligner.align([a, b], ["hello there, world", "你好 ok"], "English", sample_rate=16000)
    assert both[0] == one[0]
    assert [w.text for w in both[1]] == ["你", "好", "ok"]
    per_item = aligner.align([a, b], ["hello there, world", "你好 ok"], ["English", "Chinese"], sample_rate=16000)
    assert per_item == both
    times = [t for w in both[1] for t in (w.start, w.end)]
    assert times == sorted(times)  # repaired: never out of order


def test_pieces_offsets_and_async(aligner: Aligner) -> None:
    waves = [noise(1.5, seed=3), noise(0.2, seed=4)]  # 0.2 s is padded to 0.5 s, as the official library does
    texts = ["one two", "three"]
    plain = aligner.align_pieces(waves, texts, "English")
    shifted = aligner.align_pieces(waves, texts, "English", offsets=[0.0, 12.5])
    assert shifted[0] == plain[0]
    assert [(w.start, w.end) for w in shifted[1]] == [(round(w.start + 12.5, 3), round(w.end + 12.5, 3))
                                                      for w in plain[1]]
    assert asyncio.run(aligner.align_pieces_async(waves, texts, "English")) == plain
    futures = aligner.submit_pieces(waves, texts, "English")
    assert [f.result() for f in futures] == plain


def test_nothing_to_align(aligner: Aligner) -> None:
    assert aligner.align_pieces([noise(1.0)], ["... !?"], "English") == [[]]


def test_errors(aligner: Aligner) -> None:
    wave = noise(1.0)
    with pytest.raises(ValueError, match="not supported by the forced aligner; supported: Chinese, English"):
        aligner.align_pieces([wave], ["hi"], "Arabic")
    with pytest.raises(ValueError, match="longer than the aligner can time .*180 s"):
        aligner.align_pieces([noise(21.0)], ["hi"], "English")
    with pytest.raises(ValueError, match="must match 1:1"):
        aligner.align_pieces([wave, wave], ["hi"], "English")
    with pytest.raises(ValueError, match="2 languages for 1"):
        aligner.align_pieces([wave], ["hi"], ["English", "German"])
    with pytest.raises(ValueError, match="1-D float"):
        aligner.align_pieces([np.zeros((2, 100), np.float32)], ["hi"], "English")
    with pytest.raises(ValueError, match="use submit_alignment"):
        aligner.engine.submit(RequestSpec([1, 2, 3], 4, waveform=wave))
    prompt = aligner._prepare(wave, "hi", None)[2]
    for bad, message in (([], "non-empty"), ([len(prompt.ids)], "must lie in"), ([3, 3], "distinct")):
        with pytest.raises(ValueError, match=message):
            aligner.engine.submit_alignment(prompt.ids, positions=bad, waveform=wave)


def test_asr_checkpoint_is_refused(tiny_original) -> None:
    with pytest.raises(ValueError, match="not a forced-aligner checkpoint"):
        Aligner.from_pretrained(tiny_original, device="cpu", dtype="float32")
    engine = Engine(load_checkpoint(tiny_original, device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="need a forced-aligner checkpoint"):
        engine.submit_alignment([1, 2], positions=[1], waveform=noise(1.0))
    engine.close()


def test_transcripts_are_not_broadcast(aligner: Aligner) -> None:
    with pytest.raises(ValueError, match="1 transcripts for 2 audio inputs"):
        aligner.align([noise(1.0), noise(1.0)], "hi", "English", sample_rate=16000)
