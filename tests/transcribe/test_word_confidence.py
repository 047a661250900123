"""Word confidence: ``Word.probability`` is exp of the lowest log-probability among the generated tokens that
overlap the word's characters; checked against the plain float32 reference on the tiny checkpoint (with a
tiny aligner: the words are whatever it makes of the random text), in the outputs, and in bf16 alone
against batched."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import noise, reference_logprobs

from qasr import ASR, Aligner, TranscribeOptions
from qasr.engine.cpu.native import linear_kernel
from qasr.model.tokenizer import Tokenizer
from qasr.outputs.writers import render
from qasr.results import Segment, Transcription, Word
from qasr.server.responses import verbose_json
from qasr.server.work import Finished
from qasr.testing.checkpoint import make_tiny_aligner_checkpoint
from qasr.transcribe.word_confidence import token_spans, with_probabilities

SR = 16000


@pytest.fixture(scope="module")
def aligner_path(tmp_path_factory):
    return make_tiny_aligner_checkpoint(tmp_path_factory.mktemp("aligner") / "tiny", seed=1)


def _asr(ckpt, aligner_path, dtype: str) -> ASR:
    return ASR.from_pretrained(ckpt, device="cpu", dtype=dtype,
                               aligner=Aligner.from_pretrained(aligner_path, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def asr(tiny_original, aligner_path):
    asr = _asr(tiny_original, aligner_path, "float32")
    yield asr
    asr.close()


def touched(tok: Tokenizer, ids: list[int]) -> list[set[int]]:
    """The reference rule, written out the slow way: the characters of the whole decoded text that token k
    touches are those where decoding all tokens through k differs from (or goes beyond) decoding them
    through k - 1; a token whose own bytes decode to a replacement character first, after a text that ends
    in one (an incomplete character), joined that character."""
    out = []
    before = ""
    for k in range(len(ids)):
        now = tok.decode(ids[:k + 1], skip_special_tokens=True)
        same = 0
        while same < min(len(before), len(now)) and before[same] == now[same]:
            same += 1
        own = tok.decode(ids[k:k + 1], skip_special_tokens=True)
        if same == len(before) and before.endswith("\ufffd") and own.startswith("\ufffd"):
            same -= 1
        out.append(set(range(same, len(now))))
        before = now
    return out


def test_word_probability_is_the_least_likely_of_its_tokens(asr) -> None:
    checked = 0
    for seed, seconds in ((31, 2.5), (32, 4.0), (33, 6.5)):
        wave = noise(seconds, seed=seed)
        (piece,) = asr._core.prepare(wave, TranscribeOptions(sample_rate=SR, language="English"))
        [t] = asr.transcribe(wave, TranscribeOptions(sample_rate=SR, ignore_eos=True), language="English",
                             max_new_tokens=30, timestamps="word")
        (seg,) = t.segments
        assert seg.words, f"the tiny aligner gave no words for {t.text!r}"
        ids = list(t.token_ids)
        want = reference_logprobs(asr._core.checkpoint, piece.samples, list(piece.prompt), ids)
        tok = asr._core.checkpoint.tokenizer
        raw = tok.decode(ids, skip_special_tokens=True)
        chars = touched(tok, ids)
        at = raw.index(seg.text)  # the language is forced: the whole output is the transcript
        where = at
        for w in seg.words:
            start = raw.index(w.text.split()[0], where)
            end = raw.index(w.text.split()[-1], start) + len(w.text.split()[-1])
            where = end
            mine = [k for k in range(len(ids)) if chars[k] & set(range(start, end))]
            assert mine, w
            assert w.probability is not None
            assert math.log(w.probability) == pytest.approx(min(want[k] for k in mine), abs=1e-4), (w, mine)
            checked += 1
    assert checked >= 10


def test_a_character_split_over_tokens_counts_for_its_word(asr) -> None:
    """'é' is two bytes: with each byte its own token, both count for the word ("café"), and the space
    token before the next word counts for none."""
    tok = asr._core.checkpoint.tokenizer
    ids = [tok.token_to_id(t) for t in ("ca", "f", "Ã", "©", "Ġ", "au")]
    if None in ids:  # spell it with single characters, which every byte-level vocabulary has
        ids = [tok.token_to_id(t) for t in ("c", "a", "f", "Ã", "©", "Ġ", "a", "u")]
    assert None not in ids and tok.decode(ids) == "café au"
    spans = token_spans(tok, ids, "café au")
    assert spans is not None
    words = (Word("café", 0.0, 0.5), Word("au", 0.5, 1.0))
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    got = with_probabilities(words, tok, ids, logprobs, "café au", "café au", "English")
    split = [k for k, t in enumerate(ids) if tok.decode([t]) == "\ufffd"]
    assert len(split) == 2 and all(spans[k] == (3, 4) for k in split)  # both bytes touch the 'é'
    space = next(k for k, t in enumerate(ids) if tok.decode([t]) == " ")
    assert math.log(got[0].probability) == pytest.approx(logprobs[split[-1]])  # the last byte: the lowest
    assert math.log(got[1].probability) == pytest.approx(logprobs[-1])
    assert spans[space] == (4, 5)  # the space: between the words, part of neither


def test_outputs_carry_word_probability() -> None:
    words = (Word("call", 0.0, 0.4, probability=0.98765), Word("anna", 0.4, 0.9, probability=0.5))
    t = Transcription("call anna", "English", 1.0, segments=(Segment(0.0, 1.0, "call anna", words=words),),
                      finish_reason="stop", timestamps="word")
    data = json.loads(render(t, "json"))
    assert [w["probability"] for w in data["segments"][0]["words"]] == [0.9877, 0.5]
    body = verbose_json(Finished(t, ((1, 2),), 10, 5, 7, 0.1), words=True)
    assert [(w["word"], w["probability"]) for w in body["words"]] == [("call", 0.9877), ("anna", 0.5)]
    tsv = render(t, "tsv").splitlines()
    assert tsv[0] == "start\tend\ttext\tprobability" and tsv[1] == "0\t900\tcall anna\t0.5"  # the cue's least sure
    plain = Transcription("call anna", "English", 1.0, segments=(Segment(0.0, 1.0, "call anna"),))
    assert render(plain, "tsv").splitlines()[0] == "start\tend\ttext"  # no word scores: the columns as before


def test_word_probabilities_do_not_depend_on_the_batch(tiny_original, aligner_path) -> None:
    """bf16 on qasr's row-invariant kernels: a clip alone and among others gives the same bits."""
    if linear_kernel() is None:
        pytest.skip("bf16 row invariance rests on qasr's AVX512-BF16 kernels (oneDNN's fallback lacks it)")
    asr = _asr(tiny_original, aligner_path, "bfloat16")
    try:
        waves = [noise(s, seed=40 + k) for k, s in enumerate((1.5, 3.0, 5.5, 2.0))]
        options = TranscribeOptions(sample_rate=SR, language="English", max_new_tokens=24, ignore_eos=True,
                                    timestamps="word")
        alone = [asr.transcribe(w, options)[0] for w in waves]
        together = asr.transcribe(waves, options)
    finally:
        asr.close()
    scores = [[w.probability for s in t.segments for w in s.words] for t in alone]
    assert any(scores) and all(p is not None for ps in scores for p in ps)
    assert [[w.probability for s in t.segments for w in s.words] for t in together] == scores
    assert np.all(np.array([p for ps in scores for p in ps]) <= 1.0)
