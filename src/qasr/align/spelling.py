"""Giving aligned units back the transcript's spelling.

The aligner times cleaned units (letters, digits and apostrophes only; one unit per CJK ideograph), so
"Hello, world." comes back as "Hello" and "world". Subtitles and editors want the words as written,
punctuation included. Each whitespace-separated token of the transcript takes the times of the units
inside it; a token with ideographs becomes one word per ideograph with the punctuation around it
attached; a token with no unit at all (a lone dash) joins the word before it. When the units do not
follow the text in order (e.g. a Japanese or Korean tokenizer split differently), the units are
returned unchanged rather than guessed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from qasr.align.units import is_cjk, is_kept
from qasr.results import Word


def display_words(text: str, units: Sequence[Word]) -> tuple[Word, ...]:
    """Words with the transcript's spelling and the times of the units they contain."""
    words: list[Word] = []
    k = 0
    for token in re.findall(r"\S+", text):
        kept = "".join(c for c in token if is_kept(c))
        mine: list[Word] = []
        while kept and k < len(units) and units[k].text and kept.startswith(units[k].text):
            kept = kept[len(units[k].text):]
            mine.append(units[k])
            k += 1
        if kept:  # the token holds text the units do not account for: the split differs from ours
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
    """Split a token like "你好，世界。" at its units; punctuation joins the unit before it (or, at the
    start, the first unit)."""
    pieces: list[str] = []
    lead = ""
    pos = 0
    for unit in units:
        # skip what is not kept, then take the unit's characters (kept characters only)
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
