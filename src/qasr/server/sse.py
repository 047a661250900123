"""Server-sent events as OpenAI's transcription stream sends them: ``transcript.text.delta`` events, then
one ``transcript.text.done``; a failure after the stream began is an ``event: error`` with an error body."""

from __future__ import annotations

import json

MEDIA_TYPE = "text/event-stream"


def event(data: dict, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def delta_event(delta: str) -> bytes:
    return event({"type": "transcript.text.delta", "delta": delta})


def done_event(text: str, usage: dict) -> bytes:
    return event({"type": "transcript.text.done", "text": text, "usage": usage})


def error_event(body: dict) -> bytes:
    return event(body, name="error")
