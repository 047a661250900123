"""The answer bodies of POST /v1/audio/transcriptions, one per response_format."""

from __future__ import annotations

import zlib

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from qasr.outputs import render
from qasr.results import Segment
from qasr.server.work import Finished

_MEDIA = {"text": "text/plain; charset=utf-8", "srt": "application/x-subrip; charset=utf-8",
          "vtt": "text/vtt; charset=utf-8"}


def duration_usage(seconds: float) -> dict:
    return {"type": "duration", "seconds": round(seconds, 3)}


def token_usage(done: Finished) -> dict:
    """OpenAI's token usage object: prompt (audio placeholders and text) in, generated tokens out."""
    return {"type": "tokens", "input_tokens": done.input_tokens, "output_tokens": done.output_tokens,
            "total_tokens": done.input_tokens + done.output_tokens,
            "input_token_details": {"audio_tokens": done.audio_tokens,
                                    "text_tokens": done.input_tokens - done.audio_tokens}}


def compression_ratio(text: str) -> float:
    """Whisper's repetition signal: UTF-8 bytes over zlib-compressed bytes (high means repetitive)."""
    data = text.encode()
    return round(len(data) / len(zlib.compress(data)), 4) if data else 0.0


def _segment(i: int, seg: Segment, tokens: tuple[int, ...], words: bool) -> dict:
    d = {"id": i, "seek": round(seg.start * 100),  # in 10 ms frames from the start, as Whisper counts
         "start": seg.start, "end": seg.end, "text": seg.text, "tokens": list(tokens),
         "temperature": 0.0,  # decoding is greedy
         "avg_logprob": None,  # the engine returns no log probabilities
         "compression_ratio": compression_ratio(seg.text),
         "no_speech_prob": None}  # the model has no such output; silence gives an empty text instead
    if words:
        d["words"] = [{"word": w.text, "start": w.start, "end": w.end} for w in seg.words]
    return d


def verbose_json(done: Finished, words: bool) -> dict:
    t = done.transcription
    body = {"task": "transcribe", "language": t.language, "duration": t.duration, "text": t.text,
            "segments": [_segment(i, s, toks, words)
                         for i, (s, toks) in enumerate(zip(t.segments, done.segment_tokens, strict=True))],
            "usage": duration_usage(t.duration)}
    if words:
        body["words"] = [{"word": w.text, "start": w.start, "end": w.end} for s in t.segments for w in s.words]
    return body


def render_response(done: Finished, fmt: str, words: bool = False) -> Response:
    t = done.transcription
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": duration_usage(t.duration), "language": t.language})
    if fmt == "verbose_json":
        return JSONResponse(verbose_json(done, words))
    return PlainTextResponse(render(t, {"text": "txt"}.get(fmt, fmt)), media_type=_MEDIA[fmt])
