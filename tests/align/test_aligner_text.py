"""The aligner's text side against transformers' own functions: unit splitting, the monotonic repair,
and the errors for unsupported languages and missing optional tokenizers."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from qasr.align.timestamps import repair_monotonic, words_from_classes
from qasr.align.units import ALIGNER_LANGUAGES, normalize_aligner_language, split_units

qwen3_asr = pytest.importorskip("transformers.models.qwen3_asr.processing_qwen3_asr")


def _reference_split(text: str, language: str | None = None) -> list[str]:
    # split_words_for_alignment does not use the processor instance
    return qwen3_asr.Qwen3ASRProcessor.split_words_for_alignment(None, text, language)


TEXTS = [
    "Hello, world! It's 3.14 o'clock -- really?",
    "你好，世界！今天天气很好。",
    "我们用Python 3写了一个ASR系统, it works well（真的）!",
    "  Ça va? Grüße aus Zürich — naïve café, 100% sûr.  ",
    "Привет, мир! ¿Qué tal? Ünïcödé…",
    "東京タワーは333メートルです。カタカナとひらがな",
    "한국어 문장도 test 합니다 㐀𠀀 ＡＢＣ１２３",
    "!!! ... ---",
    "",
    "emoji 🙂 and symbols #@$ ^_^ x²",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("language", [None, "English", "Chinese"])
def test_split_matches_transformers(text: str, language: str | None) -> None:
    assert split_units(text, language) == _reference_split(text, language)


def test_split_units() -> None:
    expected = ["我", "们", "用", "Python", "3", "写", "了", "it's", "fine"]
    assert split_units("我们用Python 3写了, it's fine!") == expected


def test_compatibility_supplement_stays_inside_words() -> None:
    """U+2F800-2FA1F is not among the official aligner's CJK blocks (transformers splits it out): the
    official behaviour is kept, so such a character stays part of its word."""
    text = "ab\U0002f800cd"
    assert split_units(text) == [text]
    assert _reference_split(text) == ["ab", "\U0002f800", "cd"]


@pytest.mark.parametrize("module,language,package", [("nagisa", "Japanese", "nagisa"),
                                                     ("soynlp.tokenizer", "Korean", "soynlp")])
def test_missing_optional_tokenizer_names_the_package(monkeypatch, module: str, language: str,
                                                      package: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail even where it is installed
    with pytest.raises(ImportError, match=f"pip install {package}"):
        split_units("some text", language)


def test_language_names_and_codes() -> None:
    assert normalize_aligner_language("english") == "English"
    assert normalize_aligner_language("ZH") == "Chinese"
    assert normalize_aligner_language("yue") == "Cantonese"
    assert normalize_aligner_language(None) is None
    for bad in ("Arabic", "ar", "Klingon"):
        with pytest.raises(ValueError, match="Cantonese, French"):
            normalize_aligner_language(bad)
    assert len(ALIGNER_LANGUAGES) == 11


CRAFTED = [
    [0, 80, 160, 240],
    [240, 160, 80, 0],
    [0, 800, 160, 240, 320],  # one spike: a run of 1 between two kept values
    [0, 800, 880, 240, 320],  # a run of 2
    [0, 800, 880, 960, 240, 320, 400],  # a run of 3: interpolated
    [0, 80, 1600, 1680, 1760, 1840, 160],  # a run of 4 that ends at the last kept value... or not
    [900, 0, 80, 160],  # a run at the start (left side missing)
    [0, 80, 160, 40],  # a run at the end (right side missing)
    [0, 80, 160, 40, 30, 20, 10],  # a long run at the end
    [500, 400, 300, 0, 80, 160, 240],  # a long run at the start
    [80, 80, 80, 0, 0, 0],  # ties
    [0, 240, 80, 240, 160, 320, 240, 400],  # alternating
    [160, 80, 160, 80, 160, 80],
    [40],
    [320, 0],
    [0, 1000, 80, 1000, 160, 1000, 240, 1000, 320],
]


@pytest.mark.parametrize("values", CRAFTED)
def test_repair_matches_transformers_on_crafted_input(values: list[int]) -> None:
    raw = np.asarray(values, dtype=np.float32)
    assert repair_monotonic(raw.tolist()) == qwen3_asr._fix_timestamps(raw)


def test_repair_matches_transformers_on_random_input() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        base = np.sort(rng.integers(0, 400, n))
        noisy = np.where(rng.random(n) < 0.3, rng.integers(0, 400, n), base)
        raw = (noisy * 80).astype(np.float32)
        assert repair_monotonic(raw.tolist()) == qwen3_asr._fix_timestamps(raw), trial


def test_words_from_classes_pairs_slots() -> None:
    words = words_from_classes(["a", "b"], [1, 3, 2, 5], 80.0)
    assert [(w.text, w.start, w.end) for w in words] == [("a", 0.08, 0.24), ("b", 0.24, 0.4)]
    with pytest.raises(ValueError, match="need 4 timestamps"):
        words_from_classes(["a", "b"], [1, 2, 3], 80.0)
