"""Word confidence: each aligned word's ``probability``, from the log-probabilities of the tokens it is made of.

The aligner splits the transcript into words its own way (docs/aligner.md), and the recogniser's tokens
do not follow word boundaries: a token may carry a space and a word (" alarm"), half a word, the end of
one word and the start of the next, or one byte of a character that the next token completes. So the
tokens are mapped to the transcript's characters, and a word takes every token that touches one of its
characters: a token counts for every word whose characters it overlaps (one of spaces alone counts for
none; punctuation belongs to the word it is written with, as in the word's text). A word's score is the
lowest log-probability among its tokens, so a word is as doubtful as its least likely piece;
``Word.probability`` is its exponential, a probability from 0 to 1 as faster-whisper users read it
(faster-whisper averages its tokens' probabilities instead: a minimum lets one doubtful piece of a long
word show).

A token's characters: those that decoding the tokens through it gives and decoding them only up to the
token before it does not (the bytes of a character split over two tokens decode to a replacement
character until both are there: both tokens touch it; a token that starts with bytes that cannot
start a character, after an incomplete one, touches that one too). Decoding is done in short runs
between points where the text is final (byte-level decoding is concatenative there), so the cost is
linear in the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from qasr.model.prompt import ASR_TEXT_TAG
from qasr.model.tokenizer import Tokenizer
from qasr.results import Word


def token_spans(tokenizer: Tokenizer, ids: Sequence[int], full: str) -> list[tuple[int, int]] | None:
    """``[start, end)`` in ``full`` (the decoded ids) of the characters each token touches; None when the
    runs do not add up to ``full`` (a decoder that is not concatenative), so nothing is guessed."""
    spans: list[tuple[int, int]] = []
    run_start, base, before = 0, 0, ""  # the run: tokens from run_start on, decoding to ``before`` at base
    for k in range(len(ids)):
        text = tokenizer.decode(ids[run_start:k + 1], skip_special_tokens=True)
        changed = _common_prefix(before, text)
        if changed == len(before) and before.endswith("\ufffd") and \
                tokenizer.decode(ids[k:k + 1], skip_special_tokens=True).startswith("\ufffd"):
            # the token starts with bytes that cannot start a character: they joined the incomplete one before
            # it, which stays one replacement character (so nothing before the token's own text changed)
            changed -= 1
        spans.append((min(base + changed, len(full)), min(base + len(text), len(full))))
        before = text
        # a run ends where its text is final: all of it found in ``full`` and no dangling replacement
        # character, which the next token's bytes could still join
        if full.startswith(text, base) and not text.endswith("\ufffd"):
            run_start, base, before = k + 1, base + len(text), ""
    if base + len(before) != len(full) or not full.startswith(before, base):
        return None
    return spans


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def text_offset(raw: str, text: str, forced_language: str | None) -> int | None:
    """Where a piece's ``text`` (as ``parse_asr_output`` gives it) starts in its decoded output ``raw``;
    None where it is not there verbatim (a repetition loop that was collapsed)."""
    after = 0
    if not forced_language and ASR_TEXT_TAG in raw:
        after = raw.index(ASR_TEXT_TAG) + len(ASR_TEXT_TAG)
    at = raw.find(text, after)
    return None if at < 0 else at


def word_spans(words: Sequence[Word], text: str) -> list[tuple[int, int]] | None:
    """``[start, end)`` of each word in ``text``, found in order (a word the writer joined from several
    whitespace-separated parts spans them all); None when a word is not found there."""
    spans, at = [], 0
    for w in words:
        parts = w.text.split()
        if not parts:
            return None
        start = end = -1
        for part in parts:
            found = text.find(part, at)
            if found < 0:
                return None
            start = found if start < 0 else start
            end = at = found + len(part)
        spans.append((start, end))
    return spans


def with_probabilities(words: tuple[Word, ...], tokenizer: Tokenizer, token_ids: Sequence[int],
                       logprobs: Sequence[float], raw: str, text: str,
                       forced_language: str | None) -> tuple[Word, ...]:
    """``words`` with ``probability`` set: exp of the lowest log-probability among the tokens that overlap
    each word's characters. The words are returned unchanged (probability None) when the mapping cannot
    be made exactly: no log-probabilities, a transcript changed after decoding, words not found in it."""
    if not words or not logprobs or len(logprobs) != len(token_ids):
        return words
    at = text_offset(raw, text, forced_language)
    where = word_spans(words, text) if at is not None else None
    tokens = token_spans(tokenizer, token_ids, raw) if where is not None else None
    if where is None or tokens is None:
        return words
    out, k = [], 0
    for word, (ws, we) in zip(words, where, strict=True):
        ws, we = ws + at, we + at  # type: ignore[operator]
        while k < len(tokens) and tokens[k][1] <= ws:  # tokens wholly before this word (never needed again)
            k += 1
        touching = []
        for j in range(k, len(tokens)):
            if tokens[j][0] >= we:  # token starts never decrease: no later token reaches this word
                break
            if tokens[j][1] > ws:
                touching.append(logprobs[j])
        out.append(replace(word, probability=math.exp(min(touching))) if touching else word)
    return tuple(out)
