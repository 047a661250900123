"""The streamed transcript text (qasr.server.textstream): no prompt preamble leaks, nothing is sent that the
final text takes back, and segments join as join_segment_texts joins them."""

from __future__ import annotations

from qasr.server.textstream import Joiner, PieceText
from qasr.stitch import join_segment_texts


def _stream(pieces: list[str], forced: bool = False) -> tuple[list[str], str]:
    """Feed each piece's text one character per 'token' (the decoder is the identity on char lists)."""
    joiner, deltas = Joiner(), []
    for raw in pieces:
        chars = list(raw)
        text = PieceText(lambda ids, c=chars: "".join(c[: len(ids)]), forced)
        for k in range(len(chars)):
            first = not text.text
            if d := joiner.add(text.push(k), first_of_piece=first):
                deltas.append(d)
    return deltas, joiner.text


def test_preamble_is_never_streamed() -> None:
    deltas, text = _stream(["language English<asr_text>set an alarm "])
    assert text == "set an alarm" and "language" not in "".join(deltas) and "<asr" not in "".join(deltas)
    assert _stream(["language English"])[1] == ""  # no tag: no transcript at all
    assert _stream([" call anna "], forced=True)[1] == "call anna"


def test_held_back_until_settled() -> None:
    deltas, text = _stream(["language English<asr_text>a  b\ufffd c"])
    assert text == "a  b\ufffd c"  # a replacement char inside the text is kept once followed by more
    assert all(not d.endswith(" ") for d in deltas[:-1] if d.strip())  # trailing spaces wait for the next word


def test_segments_join_like_join_segment_texts() -> None:
    pieces = ["language English<asr_text>one two", "language None<asr_text>", "language English<asr_text>three",
              "language Chinese<asr_text>你好", "language Chinese<asr_text>世界", "language English<asr_text>end"]
    parts = [p.split("<asr_text>", 1)[1] for p in pieces]
    assert _stream(pieces)[1] == join_segment_texts(parts) == "one two three你好世界end"
