"""Aligned units given back the transcript's spelling."""

from __future__ import annotations

import re
from collections.abc import Sequence

from qasr.align.units import is_cjk, is_kept
from qasr.results import Word


def display_words(text: str, units: Sequence[Word]) -> tuple[Word, ...]:
    """Each whitespace token with the times of its units (one word per ideograph), punctuation attached;
    units that do not follow the text come back unchanged."""
    words: list[Word] = []
    k = 0
    for token in re.findall(r"\S+", text):
        kept = "".join(c for c in token if is_kept(c))
        mine: list[Word] = []
        while kept and k < len(units) and units[k].text and kept.startswith(units[k].text):
            kept = kept[len(units[k].text):]
            mine.append(units[k])
            k += 1
        if kept:  # the units were split otherwise
            return tuple(units)
        if not mine:
            if words:  # punctuation on its own: it belongs to the word before it
                last = words[-1]
                words[-1] = Word(f"{last.text} {token}", last.start, last.end)
            continue
        if any(is_cjk(c) for c in token):
            words += _per_ideograph(token, mine)
        else:
            words.append(Word(token, mine[0].start, mine[-1].end))
    if k != len(units):
        return tuple(units)
    return tuple(words)


def _per_ideograph(token: str, units: list[Word]) -> list[Word]:
    """A token like "你好，世界。" split at its units, punctuation joining the unit before it."""
    pieces: list[str] = []
    lead = ""
    pos = 0
    for unit in units:
        chunk = ""
        while pos < len(token) and not is_kept(token[pos]):
            chunk += token[pos]
            pos += 1
        if not pieces:
            lead, chunk = chunk, ""
        elif chunk:
            pieces[-1] += chunk
        taken = 0
        body = ""
        while pos < len(token) and taken < len(unit.text):
            if is_kept(token[pos]):
                taken += 1
            body += token[pos]
            pos += 1
        pieces.append(body)
    if pieces:
        pieces[0] = lead + pieces[0]
        pieces[-1] += token[pos:]
    return [Word(p, u.start, u.end) for p, u in zip(pieces, units, strict=True)]
