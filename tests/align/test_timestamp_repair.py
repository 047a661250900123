"""The aligner's monotonic repair and word pairing against transformers' own (the oracle), in every case.

(a) Thousands of seeded class sequences (lengths 0..50, built to be out of order and degenerate: all
equal, ties, strictly decreasing, runs at the start or the end, a single value, values far beyond the
audio): ``repair_monotonic`` equals ``_fix_timestamps`` and ``words_from_classes`` equals
``decode_forced_alignment`` exactly. (b) End to end on a 0.3 s clip with a 600-class random aligner in
both layouts: ``Aligner.align``'s word times equal transformers' pipeline."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import noise

from qasr.align.timestamps import repair_monotonic, words_from_classes
from qasr.testing import make_tiny_aligner_checkpoint
from qasr.testing.tokenizer_files import write_tiny_tokenizer

transformers = pytest.importorskip("transformers")
qwen3_asr = pytest.importorskip("transformers.models.qwen3_asr.processing_qwen3_asr")

from test_aligner_parity import (  # noqa: E402
    STD,
    TEXTS,
    _decorrelate_head,
    _reference,
    load_aligners,
    make_oracle,
)


# ---------------------------------------------------------------------- (a) random class sequences
def _uniform(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    return rng.integers(0, hi, n)


def _ties(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    return rng.integers(0, min(hi, 3), n)


def _constant(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    return np.full(n, rng.integers(0, hi))


def _decreasing(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    return np.sort(rng.choice(hi + n, n, replace=False))[::-1]  # strictly decreasing


def _outliers(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    c = np.sort(rng.integers(0, hi, n))
    m = rng.random(n) < 0.3
    c[m] = rng.integers(0, hi, int(m.sum()))
    return c


def _reversed_run(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    c = np.sort(rng.integers(0, hi, n))
    s = int(rng.integers(0, n + 1))
    e = int(rng.integers(s, n + 1))
    c[s:e] = c[s:e][::-1]
    return c


def _edge_runs(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    """Values beyond everything at the start, values below everything at the end."""
    head, tail = int(rng.integers(0, n // 2 + 1)), int(rng.integers(0, n // 2 + 1))
    mid = np.sort(rng.integers(hi // 4, hi // 2 + 1, max(n - head - tail, 0)))
    c = np.concatenate([rng.integers(hi // 2, hi, head), mid, rng.integers(0, hi // 4 + 1, tail)])
    return c[:n]


def _alternating(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    low = np.sort(rng.integers(0, hi // 2 + 1, n))
    return np.where(np.arange(n) % 2 == 1, np.maximum(hi - 1 - rng.integers(0, 3, n), 0), low)


def _plateaus(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    """A few repeated values in shuffled blocks: ties inside and across out-of-order runs."""
    return rng.choice(rng.integers(0, hi, int(rng.integers(1, 4))), n)


PATTERNS: list[Callable[[np.random.Generator, int, int], np.ndarray]] = [
    _uniform, _ties, _constant, _decreasing, _outliers, _reversed_run, _edge_runs, _alternating, _plateaus]
TRIALS = 6000


def _sequences(seed: int, trials: int):  # noqa: ANN202 - yields (pattern name, class ids)
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        pattern = PATTERNS[trial % len(PATTERNS)]
        n = int(rng.integers(1, 51)) if trial % 10 else int(rng.integers(1, 4))  # many of length 1..3
        hi = int(rng.choice([1, 2, 5, 40, 600, 5000]))
        yield pattern.__name__, np.array(pattern(rng, n, hi), dtype=np.int64)  # a copy: positive strides


def test_repair_equals_transformers_on_random_sequences() -> None:
    patterns_seen, changed = set(), 0
    for trial, (name, classes) in enumerate(_sequences(seed=26, trials=TRIALS)):
        raw = classes.astype(np.float32) * np.float32(80.0)  # the pipeline's ms, float32 as in both
        ref = qwen3_asr._fix_timestamps(raw)
        assert repair_monotonic(raw.tolist()) == ref, (trial, name, classes.tolist())
        patterns_seen.add(name)
        changed += ref != [int(v) for v in raw.tolist()]
    assert len(patterns_seen) == len(PATTERNS)
    assert changed > TRIALS // 3  # most inputs really needed repairing


def test_repair_equals_transformers_on_arbitrary_floats() -> None:
    """Off the 80 ms grid, negative, huge: interpolation and int truncation agree too."""
    rng = np.random.default_rng(6)
    for trial in range(2000):
        n = int(rng.integers(1, 51))
        raw = (rng.standard_normal(n) * rng.choice([1.0, 1e3, 1e6])).astype(np.float32)
        if trial % 3 == 0:
            raw = np.round(raw, 0)  # ties
        assert repair_monotonic(raw.tolist()) == qwen3_asr._fix_timestamps(raw), (trial, raw.tolist())


@pytest.mark.parametrize("values", [[0.0], [4000.0], [0.0, 0.0], [80.0, 0.0], [160.0, 80.0, 0.0],
                                    [80.0] * 7, [46320.0, 0.0, 80.0], [0.0, 80.0, 46320.0, 11360.0]])
def test_repair_equals_transformers_on_small_degenerate_input(values: list[float]) -> None:
    raw = np.asarray(values, dtype=np.float32)
    assert repair_monotonic(raw.tolist()) == qwen3_asr._fix_timestamps(raw)


def test_empty_sequence() -> None:
    """The one input without a reference output: transformers raises on no values (max() of an empty
    sequence); qasr returns no times. The aligner never repairs an empty sequence (a transcript with
    no units returns [] before the model runs)."""
    with pytest.raises(ValueError):
        qwen3_asr._fix_timestamps(np.zeros(0, dtype=np.float32))
    assert repair_monotonic([]) == []
    assert words_from_classes([], [], 80.0) == []


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tokenizer")
    specials = write_tiny_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.Qwen3ASRProcessor(feature_extractor=transformers.Qwen3ASRFeatureExtractor(),
                                               tokenizer=tokenizer)
    return processor, specials["<timestamp>"]


@pytest.mark.parametrize("segment_ms", [80.0, 40.0, 12.5, 33.3])
def test_word_times_equal_decode_forced_alignment(processor, segment_ms: float) -> None:
    """The pairing (slots 2i and 2i + 1, float32 ms, seconds rounded to 3 decimals) on the same class
    ids as transformers' decoder, which takes them as the argmax of logits at the timestamp tokens."""
    proc, ts_id = processor
    for trial, (name, classes) in enumerate(_sequences(seed=62, trials=500)):
        if len(classes) % 2:
            classes = classes[:-1]
        if len(classes) == 0:
            continue
        words = [f"w{i}" for i in range(len(classes) // 2)]
        ids = torch.full((1, 3 * len(words) + 1), 5, dtype=torch.long)  # word, slot, slot, ... , filler
        slots = torch.tensor([3 * i + k + 1 for i in range(len(words)) for k in (0, 1)])
        ids[0, slots] = ts_id
        logits = torch.zeros(1, ids.shape[1], int(classes.max()) + 1)
        logits[0, slots, torch.from_numpy(classes)] = 1.0
        ref = proc.decode_forced_alignment(logits, ids, [words], ts_id, timestamp_segment_time=segment_ms)[0]
        got = words_from_classes(words, classes.tolist(), segment_ms)
        assert [(w.text, w.start, w.end) for w in got] == \
            [(r["text"], r["start_time"], r["end_time"]) for r in ref], (trial, name, classes.tolist())


# ---------------------------------------------------------------------- (b) the 0.3 s clip, end to end
CLASSES = 600  # 48 s of classes for 0.3 s of audio: most of what the random head says is "beyond"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    paths = {layout: make_tiny_aligner_checkpoint(tmp_path_factory.mktemp(f"aligner600_{layout}"), layout=layout,
                                                  seed=3, std=STD, classify_num=CLASSES)
             for layout in ("original", "hf")}
    _decorrelate_head(paths)
    return paths


@pytest.fixture(scope="module")
def oracle(checkpoints):
    return make_oracle(checkpoints["hf"])


@pytest.fixture(scope="module")
def aligners(checkpoints):
    out = load_aligners(checkpoints)
    yield out
    for a in out.values():
        a.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("language,text", TEXTS)
def test_short_clip_word_times_equal_transformers(aligners, oracle, seed, language, text) -> None:
    """float32 on both sides, as the parity tests: in bf16 (dtype="auto" on a CPU with bf16) a slot's
    argmax can differ from the float32 reference, and the repair spreads that to its neighbours."""
    wave = noise(0.3, seed=seed)
    _, _, ref_classes, ref_words = _reference(oracle, wave, text, language)
    expected = [(r["text"], r["start_time"], r["end_time"]) for r in ref_words]
    for layout, aligner in aligners.items():
        assert aligner.checkpoint.config.classify_num == CLASSES
        words = aligner.align(wave, text, language, sample_rate=16000)[0]
        assert [(w.text, w.start, w.end) for w in words] == expected, layout
    # the case is the degenerate one: times far beyond the clip, out of order, so the repair works
    assert max(ref_classes) * 0.08 > 10 * 0.5
    assert any(b < a for a, b in zip(ref_classes[:-1], ref_classes[1:], strict=True))
