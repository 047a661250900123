"""qasr.testing.speaking: the random checkpoints the benchmarks force to speak words (or nothing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qasr import ASR, TranscribeOptions
from qasr.model.tokenizer import Tokenizer
from qasr.testing import TINY_DIMS
from qasr.testing.speaking import speaking_checkpoint, word_ids


@pytest.mark.parametrize("transcript", ["words", "empty", "steady"])
def test_greedy_decoding_runs_to_its_cap_with_the_chosen_tokens(tmp_path: Path, transcript: str) -> None:
    dims = {**TINY_DIMS, "vocab_size": 2048}  # "empty" needs ids beyond the tiny tokenizer's
    path = speaking_checkpoint(tmp_path / "ckpt", dims, transcript)
    assert speaking_checkpoint(path, dims, transcript) == path  # built once, then reused
    audio = np.random.default_rng(0).standard_normal(16000 * 2).astype(np.float32) * 0.1
    asr = ASR.from_pretrained(path, device="cpu", dtype="float32")
    try:
        result = asr.transcribe(audio, TranscribeOptions(sample_rate=16000), language="English", max_new_tokens=7)[0]
    finally:
        asr._core.engine.close(drain=False, timeout=30)
    assert result.error is None and result.finish_reason == "length" and len(result.token_ids) == 7
    if transcript in ("words", "steady"):
        kept = set(word_ids(path))
        assert kept and set(result.token_ids) <= kept
        tok = Tokenizer.from_dir(path)
        assert result.text.split() == [tok.decode([i]).strip() for i in result.token_ids]
    else:
        assert result.text == ""


def test_unknown_transcript_and_a_vocabulary_without_silent_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="words, empty or steady"):
        speaking_checkpoint(tmp_path / "x", dict(TINY_DIMS), "music")
    with pytest.raises(ValueError, match="larger vocab_size"):
        speaking_checkpoint(tmp_path / "y", dict(TINY_DIMS), "empty")
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.tmp").exists()


def test_a_steady_checkpoint_makes_the_same_words_whatever_the_audio(tmp_path: Path) -> None:
    """``steady``: the next word follows from the token before it, so clips of different noise give one text
    (a live step then makes again the tokens its prefix rolled back), where ``words`` gives each its own."""
    rng = np.random.default_rng(1)
    clips = [rng.standard_normal(int(16000 * s)).astype(np.float32) * 0.1 for s in (1.3, 2.0, 3.1)]
    texts = {}
    for transcript in ("steady", "words"):
        asr = ASR.from_pretrained(speaking_checkpoint(tmp_path / transcript, dict(TINY_DIMS), transcript),
                                  device="cpu", dtype="float32")
        try:
            texts[transcript] = {r.text for r in asr.transcribe(clips, TranscribeOptions(sample_rate=16000),
                                                                language="English", max_new_tokens=9)}
        finally:
            asr._core.engine.close(drain=False, timeout=30)
    assert len(texts["steady"]) == 1 and len(texts["words"]) > 1
