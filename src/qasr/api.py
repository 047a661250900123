"""The ASR facade: load a checkpoint once, transcribe files, bytes or arrays.

Every input is decoded, split when longer than ``max_chunk_sec`` and turned into pieces (audio, prompt,
token cap; see ``qasr.pieces``), which go to the engine as soon as their input is decoded. A bad input
yields a Transcription with ``error`` set; the other inputs in the same call still finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.audio.io import AudioError, load_audio
from qasr.engine.engine import Engine, EngineConfig
from qasr.engine.request import GenerationResult
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.prompt import SUPPORTED_LANGUAGES, merge_languages, normalize_language, parse_asr_output
from qasr.pieces import Piece, make_pieces
from qasr.results import Segment, Transcription

log = logging.getLogger(__name__)

AudioInput = str | os.PathLike | bytes | np.ndarray | tuple
Outcome = GenerationResult | BaseException  # what became of one piece's request

_FINISH = {"eos": "stop", "length": "length"}  # the engine's words -> the OpenAI-style words we report
_SEVERITY = {"stop": 0, "length": 1}  # a reason we do not know ranks worst


@dataclass(frozen=True)
class _Call:
    """One call's inputs with its per-input options, validated before any audio is touched."""

    items: list[AudioInput]
    languages: list[str | None]  # canonical names
    contexts: list[str]
    sample_rate: int | None
    max_new_tokens: int | None


class ASR:
    def __init__(self, checkpoint: Checkpoint, max_chunk_sec: float = 1200.0,
                 engine: EngineConfig | None = None, max_pending: int = 256,
                 max_tokens_per_second: float = 15.0) -> None:
        """``max_pending`` bounds decoded-but-unfinished pieces (memory for huge input lists);
        ``max_tokens_per_second`` sets each piece's default generation cap from its duration (see
        ``prepare``), so a repetition loop stops early instead of running on."""
        self.checkpoint = checkpoint
        self.max_chunk_sec = max_chunk_sec
        self.max_pending = max_pending
        self.max_tokens_per_second = max_tokens_per_second
        self.engine = Engine(checkpoint, engine or EngineConfig())

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "Qwen/Qwen3-ASR-0.6B", device: str = "auto",
                        dtype: str | torch.dtype = "auto", **kwargs: object) -> ASR:
        """Load from a local directory or a hub id (local cache first); see ``ASR.__init__`` for kwargs."""
        return cls(load_checkpoint(model, device=device, dtype=dtype), **kwargs)  # type: ignore[arg-type]

    @property
    def supported_languages(self) -> tuple[str, ...]:
        return self.checkpoint.config.support_languages or SUPPORTED_LANGUAGES

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ preparing requests
    def prepare(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                context: str | Sequence[str] = "", sample_rate: int | None = None,
                max_new_tokens: int | None = None) -> list[Piece]:
        """Decode the inputs and return their pieces, ready for ``engine.submit``, in input order.

        Arguments are those of ``transcribe``. Each piece names its input (``source``, ``item``); a long
        input gives several. The default cap is ``ceil(max_tokens_per_second x seconds) + 24`` per
        piece, whatever the checkpoint's generation_config says; ``max_new_tokens`` replaces it.
        Unlike ``transcribe``, a bad input raises: AudioError (a ValueError) whose message starts with
        the input's name. ``assemble`` turns a piece list and its results into a Transcription.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens)
        return [piece for i in range(len(call.items)) for piece in self._prepare_item(call, i)]

    def _call(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence,
              context: str | Sequence[str], sample_rate: int | None, max_new_tokens: int | None) -> _Call:
        items = _as_list(audio)
        languages = [normalize_language(lang) for lang in _broadcast(language, len(items), "language")]
        contexts = [c or "" for c in _broadcast(context, len(items), "context")]
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return _Call(items, languages, contexts, sample_rate, max_new_tokens)

    def _prepare_item(self, call: _Call, i: int) -> list[Piece]:
        """Decode input ``i`` into pieces; any failure is an AudioError naming the input."""
        item = call.items[i]
        name = _name(item)
        try:
            wave = load_audio(item, call.sample_rate)
            return make_pieces(self.checkpoint, wave, source=name, item=i, context=call.contexts[i],
                               language=call.languages[i], max_new_tokens=call.max_new_tokens,
                               max_chunk_sec=self.max_chunk_sec, tokens_per_second=self.max_tokens_per_second)
        except ValueError as exc:  # AudioError included
            msg = str(exc)
            raise AudioError(msg if msg.startswith(name) else f"{name}: {msg}") from exc

    def _submit(self, piece: Piece, ignore_eos: bool) -> Future:
        try:
            return self.engine.submit(piece.prompt, waveform=piece.samples, max_new_tokens=piece.max_new_tokens,
                                      ignore_eos=ignore_eos)
        except Exception as exc:  # noqa: BLE001 - a refusal at submit is this input's error, like one later
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    # ------------------------------------------------------------------ transcribing
    def transcribe(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                   context: str | Sequence[str] = "", sample_rate: int | None = None,
                   max_new_tokens: int | None = None, ignore_eos: bool = False,
                   progress: Callable[[int], None] | None = None) -> list[Transcription]:
        """Transcribe one input or a list; always returns one Transcription per input, in order.

        ``language`` forces the output language (a name or ISO code; None detects it); ``context`` is
        background text for the system turn. Scalars apply to every input, lists go item by item.
        ``sample_rate`` is needed for bare numpy arrays. ``max_new_tokens`` caps each piece (default: see
        ``prepare``); a piece cut at its cap has finish_reason "length" and logs a warning naming the
        input. ``ignore_eos`` forces exactly that many tokens (for benchmarks). ``progress`` is called
        with 1 as each piece finishes.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens)
        results: list[Transcription | None] = [None] * len(call.items)
        pieces: dict[int, list[Piece]] = {}
        outcomes: dict[int, list[Outcome]] = {}
        pending: deque[tuple[Piece, Future]] = deque()

        def settle_oldest() -> None:
            piece, fut = pending.popleft()
            mine = outcomes[piece.item]
            mine.append(_outcome(fut))  # pieces of an input are submitted, hence settled, in order
            if len(mine) == len(pieces[piece.item]):  # assemble now: the input's samples can be freed
                results[piece.item] = self._assemble(pieces.pop(piece.item), mine, warn=not ignore_eos)
            if progress is not None:
                progress(1)

        try:
            for i in range(len(call.items)):
                try:
                    pieces[i] = self._prepare_item(call, i)
                except AudioError as exc:
                    results[i] = _failed(call.items[i], str(exc))
                    continue
                outcomes[i] = []
                # submit right away: the engine works on this input while the next one is decoded
                pending.extend((piece, self._submit(piece, ignore_eos)) for piece in pieces[i])
                while len(pending) > self.max_pending:
                    settle_oldest()
            while pending:
                settle_oldest()
        except BaseException:  # KeyboardInterrupt while waiting: stop our requests, free their KV
            for _, fut in pending:
                fut.cancel()
            raise
        return results  # type: ignore[return-value]

    async def transcribe_async(self, audio: AudioInput | Sequence[AudioInput],
                               language: str | None | Sequence = None, context: str | Sequence[str] = "",
                               sample_rate: int | None = None, max_new_tokens: int | None = None,
                               ignore_eos: bool = False,
                               progress: Callable[[int], None] | None = None) -> list[Transcription]:
        """``transcribe`` for asyncio: same arguments, same results, the event loop never blocks.

        Audio is decoded in worker threads; at most ``max_pending`` inputs are in flight at once.
        Cancelling the awaiting task cancels its engine requests. ``progress`` runs on the event loop.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens)
        slots = asyncio.Semaphore(self.max_pending)

        async def one(i: int) -> Transcription:
            async with slots:
                try:
                    pieces = await asyncio.to_thread(self._prepare_item, call, i)
                except AudioError as exc:
                    return _failed(call.items[i], str(exc))
                futures = [self._submit(piece, ignore_eos) for piece in pieces]
                waiters = [asyncio.wrap_future(fut) for fut in futures]
                if progress is not None:
                    for waiter in waiters:
                        waiter.add_done_callback(lambda _: progress(1))
                try:
                    # wait() rather than gather(): a piece's error or cancellation is an outcome, and only
                    # our own cancellation raises here
                    await asyncio.wait(waiters)
                finally:
                    for fut in futures:  # no-op for finished requests; stops the rest when we are cancelled
                        fut.cancel()
                return self._assemble(pieces, [_outcome(w) for w in waiters], warn=not ignore_eos)

        return list(await asyncio.gather(*(one(i) for i in range(len(call.items)))))

    # ------------------------------------------------------------------ results
    def assemble(self, pieces: Sequence[Piece], results: Sequence[Outcome]) -> Transcription:
        """One input's Transcription from its pieces (as ``prepare`` gave them) and their engine results.

        ``results[k]`` is piece k's GenerationResult, or the exception its request ended with (which
        makes the whole input fail, as in ``transcribe``).
        """
        return self._assemble(list(pieces), list(results), warn=True)

    def _assemble(self, pieces: list[Piece], outcomes: list[Outcome], warn: bool) -> Transcription:
        if len(pieces) != len(outcomes) or not pieces:
            raise ValueError(f"need one result per piece, got {len(outcomes)} for {len(pieces)} pieces")
        if len({(p.item, p.source) for p in pieces}) > 1:
            raise ValueError("these pieces come from several inputs; assemble one input's pieces at a time")
        source = pieces[0].source
        duration = max(p.offset + p.duration for p in pieces)
        tok = self.checkpoint.tokenizer
        texts, langs, raws, ids, segments = [], [], [], [], []
        for piece, out in sorted(zip(pieces, outcomes, strict=True), key=lambda po: po[0].offset):
            if not isinstance(out, GenerationResult):
                why = "request cancelled" if isinstance(out, (CancelledError, asyncio.CancelledError)) else str(out)
                return Transcription("", "", duration, error=f"{source}: {why}", source=source)
            raw = tok.decode(out.token_ids, skip_special_tokens=True)
            lang, text = parse_asr_output(raw, piece.language)
            reason = _FINISH.get(out.finish_reason, out.finish_reason)
            if reason == "length" and warn:
                log.warning("%s: the piece at %.1f s was cut at max_new_tokens=%d; its text may be incomplete",
                            source, piece.offset, piece.max_new_tokens)
            texts.append(text)
            langs.append(lang)
            raws.append(raw)
            ids += out.token_ids
            segments.append(Segment(round(piece.offset, 3), round(piece.offset + piece.duration, 3), text,
                                    finish_reason=reason))
        worst = max((s.finish_reason for s in segments), key=lambda r: _SEVERITY.get(r, len(_SEVERITY)))
        return Transcription(text="".join(texts), language=merge_languages(langs), duration=duration,
                             raw="".join(raws), token_ids=tuple(ids), segments=tuple(segments), source=source,
                             finish_reason=worst)


def _outcome(fut: Future | asyncio.Future) -> Outcome:
    """The future's result or its error (waiting for it when it is a pending concurrent future)."""
    try:
        return fut.result()
    except (Exception, asyncio.CancelledError) as exc:  # asyncio's CancelledError is a BaseException
        return exc


def _failed(item: AudioInput, error: str) -> Transcription:
    return Transcription("", "", 0.0, error=error, source=_name(item))


def _as_list(audio: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    if isinstance(audio, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, tuple)):
        return [audio]  # a tuple is one (array, sample_rate) input
    return list(audio)


def _broadcast(value: object, n: int, what: str) -> list:
    if value is None or isinstance(value, str):
        return [value] * n
    values = list(value)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"{what}: got {len(values)} values for {n} inputs")
    return values


def _name(item: AudioInput) -> str:
    if isinstance(item, (str, os.PathLike)):
        return str(Path(item))
    if isinstance(item, (bytes, bytearray, memoryview)):
        return "bytes input"
    return "array input"
