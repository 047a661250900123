"""The streamed answer of POST /v1/audio/transcriptions, as OpenAI's server-sent events: text
deltas, a segment event per segment (verbose_json), then ``done``, or ``error`` after a failure.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

from qasr.model.prompt import ASR_TEXT_TAG
from qasr.outputs.writers import score
from qasr.results import Segment
from qasr.transcribe.text import is_unspaced

MEDIA_TYPE = "text/event-stream"


def event(data: dict, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def delta_event(delta: str) -> bytes:
    return event({"type": "transcript.text.delta", "delta": delta})


def segment_event(index: int, segment: Segment) -> bytes:
    data = {"type": "transcript.text.segment", "id": f"seg_{index:03d}", "start": segment.start,
            "end": segment.end, "text": segment.text}
    if segment.words:
        data["words"] = [{"word": w.text, "start": w.start, "end": w.end, "probability": score(w.probability)}
                         for w in segment.words]
    return event(data, name="transcript.text.segment")


def done_event(text: str, usage: dict) -> bytes:
    return event({"type": "transcript.text.done", "text": text, "usage": usage})


def error_event(body: dict) -> bytes:
    return event(body, name="error")


class TokenHandoff:
    """Hands ``(queue, token)`` pairs from any thread to asyncio queues on ``loop``, in order, with one
    loop wake-up per burst (an engine step's tokens for every stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, int | None]] = []
        self._scheduled = False

    def sender(self, queue: asyncio.Queue) -> Callable[[int | None], None]:
        """An engine ``on_token`` callback that feeds ``queue`` (a token, then None at the end)."""
        return lambda token: self.post(queue, token)

    def post(self, queue: asyncio.Queue, token: int | None) -> None:
        with self._lock:
            self._pending.append((queue, token))
            if self._scheduled:
                return  # the drain already scheduled will take this one too
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed (server shut down): nobody is left to read the tokens
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        for queue, token in batch:
            queue.put_nowait(token)


_REPLACEMENT = "\ufffd"
_FALLBACK_IDS = 16  # a tail of twice this many ids still ending in U+FFFD is split before its last 16


class PieceText:
    """One piece's transcript, grown token by token: nothing before the ``<asr_text>`` tag; trailing
    whitespace and a half UTF-8 character wait for later text (the final text is stripped). The deltas are
    those of decoding the whole piece at every step, but only the ids after the last clean boundary are
    decoded again: work per token is bounded, not linear in the piece."""

    def __init__(self, decode: Callable[[list[int]], str], forced_language: bool) -> None:
        self._decode = decode
        self._body = forced_language  # past the tag (a forced language has no preamble)
        # the text seen is ``lead + decode(tail)[skip:]`` after what was consumed (emitted, or preamble)
        self._tail: list[int] = []  # ids since the last clean boundary
        self._lead = ""  # text before that boundary not consumed yet
        self._skip = 0  # chars of decode(tail) consumed
        self.text = ""  # emitted so far

    def push(self, token: int) -> str:
        """Add one generated token; return the text it settles (often "")."""
        return self.extend([token])

    def extend(self, tokens: list[int]) -> str:
        """Add generated tokens; return the text they settle (often "")."""
        if not tokens:
            return ""
        self._tail.extend(tokens)
        decoded = self._decode(self._tail)
        window = self._lead + decoded[self._skip:]
        new = ""
        if not self._body:
            at = window.find(ASR_TEXT_TAG)
            if at < 0:  # still the `language X` preamble: keep what a tag split across tokens needs
                self._consume(max(0, len(window) - len(ASR_TEXT_TAG)))
            else:
                self._body = True
                self._consume(at + len(ASR_TEXT_TAG))
                window = window[at + len(ASR_TEXT_TAG):]
        if self._body:
            head = window if self.text else window.lstrip()  # the body's leading whitespace never shows
            settled = head.rstrip()
            while settled.endswith(_REPLACEMENT):
                settled = settled[:-1].rstrip()
            if settled:
                new = settled
                self._consume(len(window) - len(head) + len(settled))
                self.text += new
        self._advance(decoded)
        return new

    def _consume(self, n: int) -> None:
        """Drop the first ``n`` chars of the window."""
        if n <= len(self._lead):
            self._lead = self._lead[n:]
        else:
            self._skip += n - len(self._lead)
            self._lead = ""

    def _advance(self, decoded: str) -> None:
        """Move the boundary past every id whose text is final: a decoded text that does not end in U+FFFD
        ends on a whole character, so later bytes cannot change it."""
        cut = len(self._tail)
        if decoded.endswith(_REPLACEMENT):
            if cut < 2 * _FALLBACK_IDS:
                return  # a half character, most likely: wait for its other bytes
            # a run of undecodable bytes: split where decoding the halves apart changes nothing, so the
            # first half's last byte is already settled by the next one
            cut -= _FALLBACK_IDS
            head, rest = self._decode(self._tail[:cut]), self._decode(self._tail[cut:])
            if not rest or head + rest != decoded:
                return
            decoded = head
        self._lead += decoded[self._skip:]
        self._skip = max(0, self._skip - len(decoded))
        del self._tail[:cut]


class Joiner:
    """Joins the pieces' deltas into one stream, with a space where ``join_segment_texts`` puts one."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, delta: str, first_of_piece: bool) -> str:
        if not delta:
            return ""
        if first_of_piece and self.text and not (is_unspaced(self.text[-1]) or is_unspaced(delta[0])):
            delta = " " + delta
        self.text += delta
        return delta
