"""Log-mel features against transformers' WhisperFeatureExtractor, one utterance at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import noise

from qasr.audio.features import LogMel

transformers = pytest.importorskip("transformers")

LENGTHS = [0.2, 1.0, 3.7, 8.0, 8.01, 17.0, 61.0]


@pytest.fixture(scope="module")
def whisper():
    return transformers.WhisperFeatureExtractor(feature_size=128)


@pytest.mark.parametrize("seconds", LENGTHS)
def test_features_match_whisper_extractor(whisper, seconds: float) -> None:
    x = noise(seconds, seed=int(seconds * 100))
    ref = whisper(x, sampling_rate=16000, padding="longest", truncation=False, return_tensors="pt")
    ref = ref["input_features"][0]
    ours = LogMel()(x)
    assert ours.shape == ref.shape == (128, len(x) // 160)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_odd_length_and_no_padding_to_half_second(whisper) -> None:
    x = noise(0.3337)
    ours = LogMel()(x)
    assert ours.shape[1] == len(x) // 160  # short clips are not padded to 0.5 s
    ref = whisper(x, sampling_rate=16000, padding="longest", truncation=False, return_tensors="pt")
    assert torch.allclose(ours, ref["input_features"][0], atol=1e-4)


def test_features_are_independent_of_batch() -> None:
    lm = LogMel()
    a, b = noise(2.0, 1), noise(5.0, 2) * 3
    single = lm(a)
    batch = [lm(w) for w in (b, a, b)]
    assert torch.equal(batch[1], single)


def test_too_short_raises() -> None:
    with pytest.raises(ValueError):
        LogMel()(np.zeros(100, dtype=np.float32))
