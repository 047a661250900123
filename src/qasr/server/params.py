"""The form fields of POST /v1/audio/transcriptions, checked and turned into one frozen value."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.datastructures import FormData, UploadFile

from qasr.align.units import normalize_aligner_language
from qasr.server.errors import ApiError
from qasr.transcribe.options import TranscribeOptions

if TYPE_CHECKING:
    from qasr.audio.vad import VadConfig
    from qasr.transcribe.core import Core

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# a stream is transcript events whatever the format; verbose_json's also carries each segment as it is ready
STREAM_FORMATS = ("json", "text", "verbose_json")
GRANULARITIES = ("segment", "word")
TIMED_FORMATS = ("verbose_json", "srt", "vtt")  # the formats word times show in; others skip the alignment


@dataclass(frozen=True)
class TranscriptionParams:
    file: UploadFile
    filename: str
    model: str
    response_format: str
    stream: bool
    options: TranscribeOptions  # language (canonical), context (prompt), segmentation and vad (chunking_strategy),
    # timestamps ("word": timestamp_granularities[] has it and the format shows word times)
    segments: bool  # verbose_json lists segments: "segment" asked for, or nothing (OpenAI's default)

    @property
    def words(self) -> bool:
        return self.options.words


def _text(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a text field, not a file", param=name)
    return value


def _bool(form: FormData, name: str) -> bool:
    value = (_text(form, name) or "false").strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value in ("true", "1")


def _list(form: FormData, name: str) -> list[str]:
    """A list field as clients send it: repeated ``name[]`` or ``name`` entries, or one comma list."""
    values = [v for key in (f"{name}[]", name) for v in form.getlist(key)]
    if any(not isinstance(v, str) for v in values):
        raise ApiError(400, f"'{name}' must be text", param=name)
    return [part.strip() for v in values for part in v.split(",") if part.strip()]


def parse_params(form: FormData, core: Core) -> TranscriptionParams:
    upload = form.get("file")
    if upload is None:
        raise ApiError(400, "the audio file is missing: send it as the multipart field 'file'", param="file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "'file' must be a file upload (multipart with a filename), not a text field",
                       param="file")
    try:
        language = core.canonical_language(_text(form, "language"))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="language", code="unsupported_language") from exc
    fmt = (_text(form, "response_format") or "json").strip().lower()
    if fmt not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}",
                       param="response_format")
    stream = _bool(form, "stream")
    if stream and fmt not in STREAM_FORMATS:
        raise ApiError(400, "stream=true sends transcript events; use response_format json, text or verbose_json "
                       "with it", param="stream")
    _check_temperature(_text(form, "temperature"))
    granularities = _list(form, "timestamp_granularities")
    unknown = [g for g in granularities if g not in GRANULARITIES]
    if unknown:
        raise ApiError(400, f"timestamp_granularities: unknown {', '.join(unknown)}; choose segment and/or word",
                       param="timestamp_granularities")
    words = "word" in granularities
    if words and core.aligner is None:
        raise ApiError(400, "word timestamps need an aligner (--aligner); this server has none, so only "
                            "segment timestamps are available", param="timestamp_granularities")
    words_shown = words and fmt in TIMED_FORMATS
    if words_shown and language is not None:  # known now: refuse before any work, not answer without words
        try:
            normalize_aligner_language(language, core.aligner.supported_languages)
        except ValueError as exc:
            raise ApiError(400, f"word timestamps: {exc}", param="language", code="unsupported_language") from exc
    if "logprobs" in _list(form, "include"):
        raise ApiError(400, "logprobs are not available from this server", param="include")
    segmentation, vad = _chunking(form)
    options = TranscribeOptions(language=language, context=_text(form, "prompt") or "", segmentation=segmentation,
                                vad=vad, timestamps="word" if words_shown else "segment")
    return TranscriptionParams(upload, upload.filename or "the upload", _text(form, "model") or "", fmt, stream,
                               options, segments="segment" in granularities or not granularities)


def _check_temperature(value: str | None) -> None:
    """Accepted for compatibility and ignored: decoding is always greedy (what temperature 0 asks for)."""
    if value is None or not value.strip():
        return
    try:
        t = float(value)
    except ValueError:
        raise ApiError(400, f"temperature must be a number, got {value!r}", param="temperature") from None
    if not (math.isfinite(t) and 0.0 <= t <= 1.0):
        raise ApiError(400, f"temperature must be between 0 and 1, got {value}", param="temperature")


def _chunking(form: FormData) -> tuple[str, VadConfig | None]:
    """chunking_strategy: absent -> "auto" (whole up to the model's segment length, VAD segments beyond; the
    length is always the model's); "auto" -> VAD segments;
    a server_vad object (JSON text, or bracketed fields) -> VAD segments tuned by its threshold,
    prefix_padding_ms and silence_duration_ms."""
    raw = _text(form, "chunking_strategy")
    fields = {k[len("chunking_strategy["):-1]: v for k, v in form.multi_items()
              if k.startswith("chunking_strategy[") and k.endswith("]") and isinstance(v, str)}
    if raw is None and not fields:
        return "auto", None
    if raw is not None and raw.strip().lower() == "auto":
        return "vad", None
    if raw is not None:
        try:
            fields = json.loads(raw)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            raise ApiError(400, "chunking_strategy must be \"auto\" or a server_vad object", param="chunking_strategy")
    if fields.get("type", "server_vad") != "server_vad":
        raise ApiError(400, "chunking_strategy object must have type server_vad", param="chunking_strategy")
    from qasr.audio.vad import VadConfig

    try:
        tuned = {}
        if "threshold" in fields:
            tuned["threshold"] = float(fields["threshold"])
        if "prefix_padding_ms" in fields:
            tuned["speech_pad_s"] = float(fields["prefix_padding_ms"]) / 1000
        if "silence_duration_ms" in fields:
            tuned["min_silence_s"] = float(fields["silence_duration_ms"]) / 1000
        return "vad", VadConfig(**tuned)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"chunking_strategy: {exc}", param="chunking_strategy") from exc
