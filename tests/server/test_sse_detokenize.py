"""The streamed transcript's incremental detokenizer (qasr.server.sse.PieceText): the deltas of decoding each
piece from its start at every burst, byte for byte, for a fraction of the decoding."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from qasr.model.prompt import ASR_TEXT_TAG
from qasr.model.tokenizer import Tokenizer
from qasr.server.sse import PieceText

DEMO = Path(__file__).resolve().parents[2] / "models" / "qasr-demo-en"
TEXTS = ("set an alarm for six forty five", "héllo wörld", "你好世界", "emoji 🎉🎈 ok", "ünïcödé  spaces ",
         "mixed 中文 and ελληνικά", "\ufffd literal", " ")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


class FromScratch:
    """The reference: the whole piece decoded again at every burst."""

    def __init__(self, decode: Callable[[list[int]], str], forced: bool) -> None:
        self.decode, self.forced, self.ids, self.text = decode, forced, [], ""

    def extend(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        self.ids.extend(tokens)
        raw = self.decode(self.ids)
        if not self.forced:
            if ASR_TEXT_TAG not in raw:
                return ""
            raw = raw.split(ASR_TEXT_TAG, 1)[1]
        settled = raw.strip()
        while settled.endswith("\ufffd"):
            settled = settled[:-1].rstrip()
        if not settled.startswith(self.text):
            return ""
        new, self.text = settled[len(self.text):], settled
        return new


def random_stream(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Text with multi-byte characters (several ids each), random ids of the whole vocabulary (stray bytes,
    special tokens), whitespace runs and the tag, mixed."""
    tag = tok.token_to_id(ASR_TEXT_TAG)
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.5:
            ids += tok.encode(rng.choice(TEXTS))
        elif kind < 0.8:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 6))]
        elif kind < 0.9:
            ids += tok.encode(" " * rng.randint(1, 5))
        else:
            ids.append(tag)
    return ids[:n]


def bursts(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, k = [], 0
    while k < len(ids):
        size = rng.choice((1, 1, 1, 2, 3, 7))
        out.append(ids[k:k + size])
        k += size
    return out


@pytest.mark.parametrize("forced", [False, True])
def test_deltas_are_those_of_decoding_from_scratch(tok: Tokenizer, forced: bool) -> None:
    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    for seed in range(40):
        rng = random.Random(seed)
        ids = random_stream(tok, rng, rng.randint(1, 300))
        if not forced and rng.random() < 0.7:
            ids = tok.encode("language English") + [tok.token_to_id(ASR_TEXT_TAG)] + ids
        fast, slow = PieceText(decode, forced), FromScratch(decode, forced)
        for burst in bursts(ids, rng):
            assert fast.extend(burst) == slow.extend(burst), (seed, burst)
        assert fast.text == slow.text


def test_a_character_split_across_ids_comes_out_whole(tok: Tokenizer) -> None:
    text = PieceText(lambda ids: tok.decode(ids, skip_special_tokens=True), True)
    ids = tok.encode("ok 🎉 done")
    deltas = [text.push(i) for i in ids]
    assert "".join(deltas) == "ok 🎉 done"
    assert " 🎉" in deltas  # its four bytes wait for one another


def test_work_per_token_is_bounded(tok: Tokenizer) -> None:
    """2,000 tokens one at a time decode a few ids each, not the whole piece each time (2 million ids)."""
    decoded = 0

    def decode(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(7)
    stream = tok.encode("language English") + [tok.token_to_id(ASR_TEXT_TAG)] + random_stream(tok, rng, 2000)
    text = PieceText(decode, False)
    for i in stream:
        text.push(i)
    assert decoded < 10 * len(stream), decoded
    # a stray byte over and over: every prefix decodes to a trailing U+FFFD
    junk = next(i for i in range(tok.vocab_size) if tok.decode([i] * 3) == "\ufffd" * 3)
    decoded = 0
    text = PieceText(decode, True)
    for _ in range(2000):
        text.push(junk)
    assert decoded < 50 * 2000, decoded  # 2 million from scratch
