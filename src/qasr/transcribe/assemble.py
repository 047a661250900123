"""Engine outcomes to Segments and Transcriptions."""

from __future__ import annotations

import asyncio
import logging
import math
import zlib
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, replace

from qasr.engine.request import GenerationResult
from qasr.model.prompt import ASR_TEXT_TAG, merge_languages
from qasr.model.tokenizer import Tokenizer
from qasr.results import FinishReason, Segment, Transcription, Word, worst_finish_reason
from qasr.transcribe.pieces import Piece, read_output
from qasr.transcribe.text import join_segment_texts
from qasr.transcribe.word_confidence import with_probabilities
from qasr.transcribe.words import Aligned

log = logging.getLogger(__name__)

Outcome = GenerationResult | Aligned | BaseException  # what became of one piece's request


@dataclass(frozen=True)
class PieceOutput:
    """One piece's share of a Transcription."""

    segment: Segment
    language: str
    raw: str  # preamble included
    token_ids: tuple[int, ...]
    note: str | None  # why the aligner gave no words


def outcome_of(fut: Future | asyncio.Future) -> Outcome:
    """The future's result or its error."""
    try:
        return fut.result()
    except (Exception, asyncio.CancelledError) as exc:  # asyncio's CancelledError is a BaseException
        return exc


def failed(source: str, error: str) -> Transcription:
    return Transcription("", "", 0.0, error=error, source=source)


def read_piece(tokenizer: Tokenizer, piece: Piece, outcome: Outcome, source: str, warn: bool) -> PieceOutput | str:
    """The piece's share of its Transcription, or the error (a string) that ends its input."""
    timed: tuple[Word, ...] = ()
    note = None
    if isinstance(outcome, Aligned):
        timed, note, outcome = outcome.words, outcome.note, outcome.result
    if not isinstance(outcome, GenerationResult):
        why = "request cancelled" if isinstance(outcome, (CancelledError, asyncio.CancelledError)) else str(outcome)
        return f"{source}: {why}"
    raw = tokenizer.decode(outcome.token_ids, skip_special_tokens=True)
    lang, text, malformed = read_output(raw, piece)
    reason: FinishReason = outcome.finish_reason
    if malformed and reason != "length":
        reason = "malformed"
        if warn:
            log.warning("%s: the piece at %.1f s gave no transcript: the model's output %r lacks the %s tag",
                        source, piece.offset, raw[:60], ASR_TEXT_TAG)
    if reason == "length" and warn:
        log.warning("%s: the piece at %.1f s was cut at max_new_tokens=%d; its text may be incomplete",
                    source, piece.offset, piece.max_new_tokens)
    if timed:
        timed = with_probabilities(timed, tokenizer, outcome.token_ids, outcome.logprobs, raw, text, piece.language)
    segment = Segment(round(piece.offset, 3), round(piece.offset + piece.duration, 3), text, words=timed,
                      finish_reason=reason, avg_logprob=avg_logprob(outcome), compression_ratio=compression_ratio(text))
    return PieceOutput(segment, lang, raw, tuple(outcome.token_ids), note and f"{piece.offset:.1f} s: {note}")


def avg_logprob(result: GenerationResult) -> float | None:
    """The mean log-probability of the generated tokens (EOS excluded); None without them."""
    lps = result.logprobs
    if not lps or len(lps) != len(result.token_ids):
        return None
    return math.fsum(lps) / len(lps)


def compression_ratio(text: str) -> float | None:
    """Whisper's repetition signal: UTF-8 bytes over their zlib-compressed size; None for empty text."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else None


def assemble(tokenizer: Tokenizer, pieces: Sequence[Piece], outcomes: Sequence[Outcome], *, warn: bool,
             duration: float | None = None, source: str | None = None, words: bool = False) -> Transcription:
    """One input's Transcription from its pieces and their outcomes, in any order."""
    if len(pieces) != len(outcomes) or not (pieces or source is not None):
        raise ValueError(f"need one result per piece, got {len(outcomes)} for {len(pieces)} pieces")
    if len({(p.item, p.source) for p in pieces}) > 1:
        raise ValueError("these pieces come from several inputs; assemble one input's pieces at a time")
    source = pieces[0].source if pieces else source
    assert source is not None
    if duration is None:
        duration = max(p.offset + p.duration for p in pieces)
    outputs = []
    for piece, out in sorted(zip(pieces, outcomes, strict=True), key=lambda po: po[0].offset):
        read = read_piece(tokenizer, piece, out, source, warn)
        if isinstance(read, str):
            return Transcription("", "", duration, error=read, source=source)
        outputs.append(read)
    segments = [o.segment for o in outputs]
    # word times only when every segment with text has them: a mix would mislead a subtitle writer
    all_timed = words and all(s.words for s in segments if s.text)
    if words and not all_timed:
        if warn:
            log.warning("%s: word timestamps unavailable, giving segment times (%s)", source,
                        "; ".join(o.note for o in outputs if o.note) or "the aligner returned no words")
        segments = [replace(s, words=()) for s in segments]
    return Transcription(text=join_segment_texts(s.text for s in segments),
                         language=merge_languages([o.language for o in outputs]), duration=round(duration, 3),
                         raw="".join(o.raw for o in outputs), token_ids=tuple(t for o in outputs for t in o.token_ids),
                         segments=tuple(segments), source=source,
                         finish_reason=worst_finish_reason(s.finish_reason for s in segments),
                         timestamps="word" if all_timed else "segment")
