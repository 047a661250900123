"""Transcript text as tokens arrive, equal in the end to what ``ASR.assemble`` makes of the same tokens.

The model writes ``language X<asr_text>`` before the transcript (unless the prompt forced the language and
already ends with the tag), so nothing is emitted before the tag. Trailing whitespace and a trailing
incomplete character (a byte-level token that ends mid UTF-8 sequence decodes to U+FFFD) are held back until
later text settles them, because the final text is stripped and never holds a half character. Segments are
joined as ``qasr.transcribe.text.join_segment_texts`` joins them.
"""

from __future__ import annotations

from collections.abc import Callable

from qasr.model.prompt import ASR_TEXT_TAG
from qasr.transcribe.text import is_unspaced

_REPLACEMENT = "\ufffd"


class PieceText:
    """One piece's transcript, grown token by token."""

    def __init__(self, decode: Callable[[list[int]], str], forced_language: bool) -> None:
        self._decode = decode
        self._forced = forced_language
        self._ids: list[int] = []
        self.text = ""  # emitted so far

    def push(self, token: int) -> str:
        """Add one generated token; return the text it settles (often "")."""
        return self.extend([token])

    def extend(self, tokens: list[int]) -> str:
        """Add generated tokens; return the text they settle (often "")."""
        if not tokens:
            return ""
        self._ids.extend(tokens)
        raw = self._decode(self._ids)
        if not self._forced:
            if ASR_TEXT_TAG not in raw:
                return ""  # still the `language X` preamble (or output that never reaches a transcript)
            raw = raw.split(ASR_TEXT_TAG, 1)[1]
        settled = raw.strip()
        while settled.endswith(_REPLACEMENT):
            settled = settled[:-1].rstrip()
        if not settled.startswith(self.text):
            # decoding revised text already sent (not seen with byte-level BPE); deltas cannot take text
            # back, so hold on: the done event carries the final text
            return ""
        new, self.text = settled[len(self.text):], settled
        return new


class Joiner:
    """Joins the pieces' deltas into one stream: a space where join_segment_texts would put one."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, delta: str, first_of_piece: bool) -> str:
        if not delta:
            return ""
        if first_of_piece and self.text and not (is_unspaced(self.text[-1]) or is_unspaced(delta[0])):
            delta = " " + delta
        self.text += delta
        return delta
