"""Server-sent events as OpenAI's transcription stream sends them: ``transcript.text.delta`` events, then
one ``transcript.text.done``; a failure after the stream began is an ``event: error`` with an error body.
With ``response_format=verbose_json`` each segment also comes as a ``transcript.text.segment`` event (the
shape OpenAI's diarizing model sends, without a speaker), in time order, once its text is complete."""

from __future__ import annotations

import json

from qasr.outputs.writers import score
from qasr.results import Segment

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
