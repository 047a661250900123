"""Joining the texts of consecutive segments into one transcript.

Segments are transcribed independently, so each text starts and ends without the space that separated
them in speech. Scripts that write words apart get one space between segments; scripts that write
without spaces (Chinese, Japanese, Thai, ...) get none, because a space there is a visible error.
"""

from __future__ import annotations

from collections.abc import Iterable

from qasr.align.units import CJK_IDEOGRAPHS

# Scripts written without spaces between words: the CJK ideographs (align/units.py) and the blocks below.
# Hangul is deliberately absent: Korean separates words with spaces.
_UNSPACED_RANGES = CJK_IDEOGRAPHS + (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x2E80, 0x2FDF),  # CJK radicals, Kangxi radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation (、。「」)
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3100, 0x312F),  # Bopomofo
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0xFF00, 0xFFEF),  # full-width forms (，！？)
    (0x20000, 0x3134F),  # CJK extensions B-H (the ideograph table stops at F)
)


def is_unspaced(char: str) -> bool:
    """True for a character of a script that writes words without spaces between them."""
    code = ord(char)
    return any(lo <= code <= hi for lo, hi in _UNSPACED_RANGES)


class TextJoiner:
    """Joins segment texts as they come, in order: ``add`` returns what the transcript grows by (with its
    joining space), so the deltas of a stream of segments add up to ``join_segment_texts`` of them."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, text: str) -> str:
        text = text.strip()
        if not text:
            return ""  # a segment without speech never causes a double space
        delta = " " + text if self.text and not (is_unspaced(self.text[-1]) or is_unspaced(text[0])) else text
        self.text += delta
        return delta


def join_segment_texts(texts: Iterable[str]) -> str:
    """Join segment texts in order: one space between them, none where either side is unspaced script.

    Empty texts (segments without speech) are skipped, so they never cause a double space.
    """
    joiner = TextJoiner()
    for text in texts:
        joiner.add(text)
    return joiner.text
