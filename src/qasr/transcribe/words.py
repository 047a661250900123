"""Word timestamps: a piece's alignment chained onto its transcription; without words, ``Aligned.note`` says
why."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
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


# classes of silence before a piece's audio (docs/aligner.md)
LEAD_IN_CLASSES = 3


def with_lead_in(samples: np.ndarray, aligner: Aligner) -> tuple[np.ndarray, float]:
    """``samples`` after the lead-in, and its seconds (none when too long to time)."""
    lead = LEAD_IN_CLASSES * aligner.segment_ms / 1000.0
    if len(samples) / SAMPLE_RATE + lead > aligner.max_seconds:
        return samples, 0.0
    return np.concatenate([np.zeros(round(lead * SAMPLE_RATE), np.float32), samples.astype(np.float32)]), lead


@dataclass(frozen=True)
class Aligned:
    """A piece's ASR result and its words (none: ``note`` says why)."""

    result: GenerationResult
    words: tuple[Word, ...] = ()
    note: str | None = None


class WordChain:
    """Chains each transcribed piece's alignment onto it on a thread of its own: the ASR future's callback,
    on the engine's thread, only hands the piece over. ``close`` waits for what was handed over."""

    def __init__(self, aligner: Aligner, tokenizer: Tokenizer) -> None:
        self.aligner = aligner
        self.tokenizer = tokenizer
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="qasr-words")

    def close(self) -> None:
        """Run what was handed over (its alignments submitted); later pieces are chained on their own thread."""
        self._worker.shutdown(wait=True)

    def with_words(self, piece: Piece, asr: Future) -> Future:
        """A future of the piece's ``Aligned``; cancelling it cancels whichever request runs."""
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
            def done(fut: Future) -> None:  # on the aligner engine's thread: the spelling only
                try:
                    settle(Aligned(result, _inside(display_words(text, fut.result()), piece)))
                except CancelledError:
                    settle(error=CancelledError())
                except (EngineClosed, EngineBroken) as exc:  # the aligner is gone
                    settle(error=_aligner_gone(exc))
                except Exception as exc:  # noqa: BLE001 - only the word times are lost
                    settle(Aligned(result, (), f"alignment failed: {exc}"))
            return done

        def transcribed(fut: Future) -> None:
            # on the worker's thread: ``out`` settles whatever happens
            if out.done():  # cancelled while it waited
                return
            try:
                result = fut.result()
            except BaseException as exc:  # noqa: BLE001 - the piece's own failure
                settle(error=exc)
                return
            try:
                detected, text, _ = read_output(self.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                                                piece)
                language = piece.language or detected or None
                if not text.strip():
                    settle(Aligned(result))
                    return
                try:
                    aligner = self.aligner
                    normalize_aligner_language(language, aligner.supported_languages)
                    samples, lead = with_lead_in(piece.samples, aligner)
                    with lock:
                        if out.cancelled():
                            return
                        [job] = aligner.submit_pieces([samples], [text], language, offsets=[piece.offset - lead])
                        inner.append(job)
                except (ValueError, ImportError) as exc:  # a language not covered, a piece too long
                    settle(Aligned(result, (), str(exc)))
                    return
            except (EngineClosed, EngineBroken) as exc:
                settle(error=_aligner_gone(exc))
                return
            except BaseException as exc:  # noqa: BLE001 - this piece's error, never a hang
                settle(error=exc)
                return
            job.add_done_callback(aligned(result, text))

        def hand_over(fut: Future) -> None:
            # on the engine's thread: nothing else
            try:
                self._worker.submit(transcribed, fut)
            except RuntimeError:  # closed: chained here, still settled
                transcribed(fut)

        def cancelled(_: Future) -> None:
            if out.cancelled():
                with lock:
                    for f in inner:
                        f.cancel()

        out.add_done_callback(cancelled)
        asr.add_done_callback(hand_over)
        return out


def _aligner_gone(exc: EngineClosed | EngineBroken) -> BaseException:
    """The piece's error when the aligner's engine is gone (the same type)."""
    state = "is closed" if isinstance(exc, EngineClosed) else "failed"
    error = type(exc)(f"word timestamps: the forced aligner's engine {state}, so this piece's words cannot be "
                      f"timed ({exc})")
    error.__cause__ = exc
    return error


def _inside(words: tuple[Word, ...], piece: Piece) -> tuple[Word, ...]:
    """Times clamped to the piece's audio (the head's classes reach past its end)."""
    lo, hi = round(piece.offset, 3), round(piece.offset + piece.duration, 3)
    return tuple(Word(w.text, min(max(w.start, lo), hi), min(max(w.end, lo), hi)) for w in words)
