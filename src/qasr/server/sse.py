"""The streamed answer of POST /v1/audio/transcriptions (``stream=true``), as server-sent events.

Tokens from the engine thread to the event loop (``TokenHandoff``)
----------------------------------------------------------------
Tokens from the engine thread to the event loop, one loop wake-up per burst instead of one per token.

A streamed request gets its tokens on the engine thread, one per step, and every running stream gets one
in the same step. Handing each over with its own ``call_soon_threadsafe`` wakes the loop once per token
(a pipe write, an epoll return, a callback), and on a machine with few cores that CPU comes straight out
of the engine's. Here the engine thread appends to a shared list and schedules one drain only when none
is pending, so a step's tokens for all streams reach their queues in one callback.

Transcript text as tokens arrive (``PieceText``, ``Joiner``)
------------------------------------------------------------
Transcript text as tokens arrive, equal in the end to what ``Core.assemble`` makes of the same tokens.

The model writes ``language X<asr_text>`` before the transcript (unless the prompt forced the language and
already ends with the tag), so nothing is emitted before the tag. Trailing whitespace and a trailing
incomplete character (a byte-level token that ends mid UTF-8 sequence decodes to U+FFFD) are held back until
later text settles them, because the final text is stripped and never holds a half character. Segments are
joined as ``qasr.transcribe.text.join_segment_texts`` joins them.

The events (``delta_event`` ... ``error_event``)
------------------------------------------------
Server-sent events as OpenAI's transcription stream sends them: ``transcript.text.delta`` events, then
one ``transcript.text.done``; a failure after the stream began is an ``event: error`` with an error body.
With ``response_format=verbose_json`` each segment also comes as a ``transcript.text.segment`` event (the
shape OpenAI's diarizing model sends, without a speaker), in time order, once its text is complete.
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
    """Delivers ``(queue, token)`` pairs posted from any thread into asyncio queues on ``loop``, in order."""

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
