"""Word confidence: exp of the lowest log-probability among the tokens that touch a word's characters."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from qasr.model.prompt import ASR_TEXT_TAG
from qasr.model.tokenizer import Tokenizer
from qasr.results import Word


def token_spans(tokenizer: Tokenizer, ids: Sequence[int], full: str) -> list[tuple[int, int]] | None:
    """``[start, end)`` in ``full`` of each token's characters; None when they do not add up to it."""
    spans: list[tuple[int, int]] = []
    run_start, base, before = 0, 0, ""  # tokens from run_start on decode to ``before`` at base
    for k in range(len(ids)):
        text = tokenizer.decode(ids[run_start:k + 1], skip_special_tokens=True)
        changed = _common_prefix(before, text)
        if changed == len(before) and before.endswith("\ufffd") and \
                tokenizer.decode(ids[k:k + 1], skip_special_tokens=True).startswith("\ufffd"):
            # its leading bytes completed the character before it
            changed -= 1
        spans.append((min(base + changed, len(full)), min(base + len(text), len(full))))
        before = text
        # a run ends where its text is final
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
    """Where ``text`` starts in the decoded output ``raw``; None where it is not there verbatim."""
    after = 0
    if not forced_language and ASR_TEXT_TAG in raw:
        after = raw.index(ASR_TEXT_TAG) + len(ASR_TEXT_TAG)
    at = raw.find(text, after)
    return None if at < 0 else at


def word_spans(words: Sequence[Word], text: str) -> list[tuple[int, int]] | None:
    """``[start, end)`` of each word in ``text``; None when one is not there."""
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
    """``words`` with ``probability`` set; unchanged when the mapping cannot be exact."""
    if not words or not logprobs or len(logprobs) != len(token_ids):
        return words
    at = text_offset(raw, text, forced_language)
    where = word_spans(words, text) if at is not None else None
    tokens = token_spans(tokenizer, token_ids, raw) if where is not None else None
    if where is None or tokens is None:
        return words
    out, k = [], 0
    for word, (ws, we) in zip(words, where, strict=True):
        ws, we = ws + at, we + at
        while k < len(tokens) and tokens[k][1] <= ws:  # tokens wholly before this word
            k += 1
        touching = []
        for j in range(k, len(tokens)):
            if tokens[j][0] >= we:  # token starts never decrease
                break
            if tokens[j][1] > ws:
                touching.append(logprobs[j])
        out.append(replace(word, probability=math.exp(min(touching))) if touching else word)
    return tuple(out)
