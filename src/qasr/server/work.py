"""One upload's work: decode it into pieces, submit them all to the engine, collect the result. The
plain and the streamed answer share the pieces, so they carry the same text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from qasr.audio.io import EncodedAudio
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.engine.request import GenerationResult
from qasr.results import Segment, Transcription
from qasr.server.errors import ApiError
from qasr.server.sse import Joiner, PieceText, TokenHandoff
from qasr.transcribe.assemble import outcome_of, read_piece
from qasr.transcribe.pieces import NO_SAMPLES
from qasr.transcribe.words import Aligned

if TYPE_CHECKING:
    from qasr.transcribe.core import Core
    from qasr.transcribe.options import TranscribeOptions
    from qasr.transcribe.pieces import Piece

T = TypeVar("T")
Trouble = Callable[[], tuple[str, str] | None]  # ServerState.engine_trouble: (kind, why) or None
TROUBLE_CHECK_S = 1.0  # how often a request waiting on the engine asks whether it can still serve


@dataclass(frozen=True)
class Upload:
    """A decoded upload cut into pieces (offset order), and their log-mel until ``take_features``."""

    name: str
    duration: float  # seconds of the whole input, silence included
    pieces: tuple[Piece, ...]  # without features; with samples for word timestamps only
    features: list[torch.Tensor | None] = field(default_factory=list)  # per piece, made while decoding

    def take_features(self) -> list[torch.Tensor | None]:
        """Each piece's features (None: the engine makes them), once: the engine then holds the only copy and
        drops it when the piece is encoded."""
        taken = self.features[:] or [None] * len(self.pieces)
        self.features.clear()
        return taken


@dataclass(frozen=True)
class Finished:
    transcription: Transcription
    segment_tokens: tuple[tuple[int, ...], ...]  # per segment: the transcript's token ids (no preamble)
    input_tokens: int  # prompt tokens of every piece
    audio_tokens: int  # of which audio placeholders
    output_tokens: int
    ttft_s: float | None  # engine: submit -> first token of the earliest piece


def prepare_upload(core: Core, source: EncodedAudio, options: TranscribeOptions) -> Upload:
    """Decode and segment an upload and make its pieces' log-mel (blocking, off the event loop). Raises
    AudioError naming it, or what its ``watch`` raises."""
    decoded = 0.0  # seconds; the last pass reports them all
    outer = source.watch

    def watch(seconds: float) -> None:
        nonlocal decoded
        decoded = max(decoded, seconds)
        if outer is not None:
            outer(seconds)

    pieces = sorted(core.prepare(replace(source, watch=watch), options), key=lambda p: p.offset)
    words = options.words and core.aligner is not None  # the aligner reads the samples
    kept = tuple(replace(p, features=None, samples=p.samples if words or p.features is None else NO_SAMPLES)
                 for p in pieces)
    return Upload(source.name, decoded, kept, [p.features for p in pieces])


class EngineRun:
    """The engine requests of one upload; create it on the event loop that consumes its tokens."""

    def __init__(self, core: Core, upload: Upload, stream: bool, words: bool = False,
                 handoff: TokenHandoff | None = None, trouble: Trouble | None = None) -> None:
        """``words``: align each piece once transcribed. ``handoff``: the loop's shared one, else a private one.
        ``trouble``: asked while waiting; once it names a broken or stalled engine, the wait ends in a 503."""
        self.core = core
        self.upload = upload
        self.words = words
        self._trouble = trouble
        self.futures: list[Future] = []
        self._tokens: list[asyncio.Queue[int | None]] = []
        if stream:
            handoff = handoff or TokenHandoff(asyncio.get_running_loop())
        group = object()  # the pieces share one place in the engine's admission
        features = upload.take_features()
        try:
            for piece, feats in zip(upload.pieces, features, strict=True):
                on_token = None
                if stream:
                    queue: asyncio.Queue[int | None] = asyncio.Queue()
                    self._tokens.append(queue)
                    on_token = handoff.sender(queue)  # called on the engine thread: never blocks it
                if feats is not None:
                    piece = replace(piece, features=feats)
                lead = stream and not self.futures  # a streamed upload's first piece: its text starts early
                self.futures.append(core.submit(piece, words=words, on_token=on_token, group=group, lead=lead))
        except BaseException as exc:
            self.cancel()
            raise _engine_error(exc) from exc

    def cancel(self) -> None:
        """Stop every unfinished request of this upload."""
        for fut in self.futures:
            fut.cancel()

    async def finish(self) -> Finished:
        """Wait for every piece; cancelled or given up on (``trouble``), so are the engine requests."""
        waiters = [asyncio.wrap_future(f) for f in self.futures]
        try:
            if waiters:
                await self._served(asyncio.wait(waiters))
        finally:
            self.cancel()
        outcomes = []
        for w in waiters:
            try:
                outcomes.append(w.result())
            except BaseException as exc:  # noqa: BLE001 - one piece's failure is the request's error
                raise _engine_error(exc) from exc
        return self._finished(outcomes)

    async def deltas(self, segments: bool = False) -> AsyncIterator[str | tuple[int, Segment]]:
        """Transcript text as generated, piece after piece; with ``segments``, ``(index, Segment)`` after
        each piece's text. A failed piece ends them (``finish`` says why); an engine that cannot serve raises
        the 503 ``finish`` would."""
        tok = self.core.checkpoint.tokenizer
        joiner = Joiner()
        for k, (piece, queue) in enumerate(zip(self.upload.pieces, self._tokens, strict=True)):
            text = PieceText(lambda ids: tok.decode(ids, skip_special_tokens=True), piece.language is not None)
            ended = False
            while not ended:
                # one delta for all tokens already here, not one event per token
                tokens = [await self._served(queue.get())]
                while not queue.empty():
                    tokens.append(queue.get_nowait())
                if None in tokens:
                    tokens, ended = tokens[:tokens.index(None)], True
                first = not text.text  # may need the joining space
                delta = joiner.add(text.extend(tokens), first_of_piece=first)
                if delta:
                    yield delta
            if segments:
                done = asyncio.wrap_future(self.futures[k])  # settles once its words are aligned
                await self._served(asyncio.wait({done}))
                read = read_piece(tok, piece, outcome_of(done), self.upload.name, warn=False)
                if isinstance(read, str):
                    segments = False  # the request fails: finish() says why
                else:
                    yield k, read.segment

    async def _served(self, work: Awaitable[T]) -> T:
        """``await work``, asking ``trouble`` every TROUBLE_CHECK_S meanwhile: when it names an engine that
        cannot serve, ``work`` and this upload's engine requests are cancelled and a 503 raised."""
        if self._trouble is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=TROUBLE_CHECK_S)
                if done:
                    return task.result()
                trouble = self._trouble()
                if trouble is not None:
                    self.cancel()
                    kind, why = trouble
                    raise ApiError(503, f"{why}; the request was cancelled", code=f"engine_{kind}")
        finally:
            task.cancel()  # no-op once done

    def _finished(self, outcomes: list[GenerationResult | Aligned]) -> Finished:
        up = self.upload
        if up.pieces:
            t = self.core.assemble(up.pieces, outcomes)
            if t.error is not None:
                raise ApiError(500, f"transcription failed: {t.error}")
            t = replace(t, duration=round(up.duration, 3), source=up.name)
        else:  # no speech found: an empty transcript
            t = Transcription("", "", round(up.duration, 3), source=up.name, finish_reason="stop",
                              timestamps="word" if self.words else "segment")  # no words to time: none missing
        results = [o.result if isinstance(o, Aligned) else o for o in outcomes]
        asr_text = self.core.checkpoint.special.asr_text
        seg_tokens = tuple(_text_tokens(r.token_ids, asr_text, p.language is not None)
                           for p, r in zip(up.pieces, results, strict=True))
        audio_id = self.core.checkpoint.config.audio_token_id
        return Finished(t, seg_tokens, input_tokens=sum(len(p.prompt) for p in up.pieces),
                        audio_tokens=sum(p.prompt.count(audio_id) for p in up.pieces),
                        output_tokens=sum(len(r.token_ids) for r in results),
                        ttft_s=min((r.ttft_s for r in results), default=None))


def _text_tokens(ids: list[int], asr_text: int, forced: bool) -> tuple[int, ...]:
    if forced or asr_text not in ids:
        return tuple(ids) if forced else ()
    return tuple(ids[ids.index(asr_text) + 1:])


def _engine_error(exc: BaseException) -> BaseException:
    """An engine refusal or failure as the HTTP error the client should see."""
    if isinstance(exc, ApiError | asyncio.CancelledError):
        return exc
    if isinstance(exc, EngineClosed):
        return ApiError(503, "the server is shutting down", code="shutting_down")
    if isinstance(exc, EngineBroken):
        if exc.__cause__ is not None:  # the in-process engine's loop failed: it serves no more requests
            return ApiError(503, f"the inference engine is broken and serves no more requests: "
                            f"{exc.__cause__!r}", code="engine_broken")
        return ApiError(503, f"the inference engine failed: {exc}", code="engine_broken")
    if isinstance(exc, ValueError):  # refused at submit, e.g. longer than the KV cache holds
        return ApiError(400, str(exc), param="file")
    return ApiError(500, f"transcription failed: {type(exc).__name__}: {exc}")
