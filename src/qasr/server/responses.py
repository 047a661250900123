"""The answer bodies of POST /v1/audio/transcriptions, one per response_format."""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from qasr.outputs.writers import render, score
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


def _segment(i: int, seg: Segment, tokens: tuple[int, ...]) -> dict:
    return {"id": i, "seek": round(seg.start * 100),  # in centiseconds from the start, as Whisper counts
            "start": seg.start, "end": seg.end, "text": seg.text, "tokens": list(tokens),
            "temperature": 0.0,  # decoding is greedy
            # mean log-probability of the segment's generated tokens; UTF-8 bytes over zlib bytes (null: no text)
            "avg_logprob": score(seg.avg_logprob), "compression_ratio": score(seg.compression_ratio),
            "no_speech_prob": None}  # the model has no such output; silence gives an empty text instead


def verbose_json(done: Finished, words: bool = False, segments: bool = True) -> dict:
    """OpenAI's verbose_json: ``segments`` when asked for, top-level ``words`` when asked for and every
    segment was timed; without word times the segments come whatever was asked."""
    t = done.transcription
    timed = words and t.timestamps == "word"
    body = {"task": "transcribe", "language": t.language, "duration": t.duration, "text": t.text}
    if timed:
        body["words"] = [{"word": w.text, "start": w.start, "end": w.end, "probability": score(w.probability)}
                         for s in t.segments for w in s.words]
    if segments or not timed:
        body["segments"] = [_segment(i, s, toks)
                            for i, (s, toks) in enumerate(zip(t.segments, done.segment_tokens, strict=True))]
    body["usage"] = duration_usage(t.duration)
    return body


def render_response(done: Finished, fmt: str, words: bool = False, segments: bool = True) -> Response:
    t = done.transcription
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": duration_usage(t.duration), "language": t.language})
    if fmt == "verbose_json":
        return JSONResponse(verbose_json(done, words, segments))
    return PlainTextResponse(render(t, {"text": "txt"}.get(fmt, fmt)), media_type=_MEDIA[fmt])
