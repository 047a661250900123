"""Joining segment texts: a space between them, none beside a script written without spaces."""

from __future__ import annotations

from collections.abc import Iterable

from qasr.align.units import CJK_IDEOGRAPHS

# Hangul is absent: Korean separates words with spaces.
_UNSPACED_RANGES = CJK_IDEOGRAPHS + (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x2E80, 0x2FDF),  # CJK radicals, Kangxi radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3100, 0x312F),  # Bopomofo
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0xFF00, 0xFFEF),  # full-width forms
    (0x20000, 0x3134F),  # CJK extensions B-H
)


def is_unspaced(char: str) -> bool:
    code = ord(char)
    return any(lo <= code <= hi for lo, hi in _UNSPACED_RANGES)


class TextJoiner:
    """Joins segment texts in order; ``add`` returns what the transcript grows by."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, text: str) -> str:
        text = text.strip()
        if not text:
            return ""
        delta = " " + text if self.text and not (is_unspaced(self.text[-1]) or is_unspaced(text[0])) else text
        self.text += delta
        return delta


def join_segment_texts(texts: Iterable[str]) -> str:
    """Join segment texts in order; empty ones are skipped."""
    joiner = TextJoiner()
    for text in texts:
        joiner.add(text)
    return joiner.text
