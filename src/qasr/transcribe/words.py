"""Word timestamps for a transcribed piece: the ASR request, then an alignment request on its text.

``with_words`` chains the two on the engines' own threads, so a piece's alignment starts the moment its
transcript exists, batched with the other pieces' work, and the caller waits on one future. When words
cannot be had (no text, a language the aligner does not cover, a piece longer than it can time, an
alignment error) the piece keeps its segment times and ``Aligned.note`` says why. The aligner hears the
piece after a short lead-in of silence (``LEAD_IN_CLASSES``); word times are clamped to the piece's audio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from qasr.align.spelling import display_words
from qasr.align.units import normalize_aligner_language
from qasr.audio.io import SAMPLE_RATE
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.engine.request import GenerationResult
from qasr.results import Word
from qasr.transcribe.pieces import Piece, read_output

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.model.tokenizer import Tokenizer


# Timestamp classes of silence put before a piece's audio for the aligner. Why: a VAD segment can start a
# few ms before its first word, and an aligner that never heard speech begin at the very first frame (the
# demo aligner's training clips all open with 0.05 s or more of silence) then misplaces the words after
# it, by up to a second (a word put at the start of a pause). Whole classes keep the time grid on the
# piece's own; the words are shifted back by the same amount.
LEAD_IN_CLASSES = 3


def with_lead_in(samples: np.ndarray, aligner: Aligner) -> tuple[np.ndarray, float]:
    """``samples`` after LEAD_IN_CLASSES classes of silence, and that lead in seconds; unchanged (0 s) when
    the longer audio would exceed what the aligner can time."""
    lead = LEAD_IN_CLASSES * aligner.segment_ms / 1000.0
    if len(samples) / SAMPLE_RATE + lead > aligner.max_seconds:
        return samples, 0.0
    return np.concatenate([np.zeros(round(lead * SAMPLE_RATE), np.float32), samples.astype(np.float32)]), lead


@dataclass(frozen=True)
class Aligned:
    """A piece's ASR result with the words the aligner gave its text (empty with ``note`` saying why)."""

    result: GenerationResult
    words: tuple[Word, ...] = ()
    note: str | None = None


def with_words(piece: Piece, asr: Future, aligner: Aligner, tokenizer: Tokenizer) -> Future:
    """A future resolving to ``Aligned`` once the piece is transcribed and its text aligned.

    Cancelling it cancels whichever request is still running; an ASR failure is its failure."""
    out: Future = Future()
    lock = threading.Lock()
    inner: list[Future] = [asr]

    def settle(value: Aligned | None = None, error: BaseException | None = None) -> None:
        try:
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(value)
        except InvalidStateError:  # cancelled meanwhile
            pass

    def aligned(result: GenerationResult, text: str) -> Callable:
        def done(fut: Future) -> None:
            try:
                settle(Aligned(result, _inside(display_words(text, fut.result()), piece)))
            except CancelledError:
                settle(error=CancelledError())
            except (EngineClosed, EngineBroken) as exc:  # the aligner is gone: the word times asked for never come
                settle(error=_aligner_gone(exc))
            except Exception as exc:  # noqa: BLE001 - the transcript stands; only its word times are lost
                settle(Aligned(result, (), f"alignment failed: {exc}"))
        return done

    def transcribed(fut: Future) -> None:
        # runs as a done-callback on the ASR engine's thread: whatever happens, ``out`` settles (a raise
        # here would only be logged by the future, and the caller would wait forever)
        try:
            result = fut.result()
        except BaseException as exc:  # noqa: BLE001 - the piece's own failure, cancellation included
            settle(error=exc)
            return
        try:
            detected, text, _ = read_output(tokenizer.decode(result.token_ids, skip_special_tokens=True), piece)
            language = piece.language or detected or None
            if not text.strip():
                settle(Aligned(result))
                return
            try:
                normalize_aligner_language(language, aligner.supported_languages)
                samples, lead = with_lead_in(piece.samples, aligner)
                with lock:
                    if out.cancelled():
                        return
                    [job] = aligner.submit_pieces([samples], [text], language, offsets=[piece.offset - lead])
                    inner.append(job)
            except (ValueError, ImportError) as exc:  # an uncovered language, a piece too long, a missing extra
                settle(Aligned(result, (), str(exc)))
                return
        except (EngineClosed, EngineBroken) as exc:  # the aligner's engine is closed or broken
            settle(error=_aligner_gone(exc))
            return
        except BaseException as exc:  # noqa: BLE001 - anything else is this piece's error, never a hang
            settle(error=exc)
            return
        job.add_done_callback(aligned(result, text))

    def cancelled(_: Future) -> None:
        if out.cancelled():
            with lock:
                for f in inner:
                    f.cancel()

    out.add_done_callback(cancelled)
    asr.add_done_callback(transcribed)
    return out


def _aligner_gone(exc: EngineClosed | EngineBroken) -> BaseException:
    """The piece's error when the aligner's engine can no longer time its words (same type, so callers that
    map EngineClosed / EngineBroken still do; the engine's own error chained)."""
    state = "is closed" if isinstance(exc, EngineClosed) else "failed"
    error = type(exc)(f"word timestamps: the forced aligner's engine {state}, so this piece's words cannot be "
                      f"timed ({exc})")
    error.__cause__ = exc
    return error


def _inside(words: tuple[Word, ...], piece: Piece) -> tuple[Word, ...]:
    """Clamp times to the piece's audio: the head can name a class past the audio's end (its classes
    span 400 s), and a word cannot be spoken outside the audio it was heard in."""
    lo, hi = round(piece.offset, 3), round(piece.offset + piece.duration, 3)
    return tuple(Word(w.text, min(max(w.start, lo), hi), min(max(w.end, lo), hi)) for w in words)
