"""The ASR facade: load a checkpoint once, transcribe files, bytes or arrays.

Every input is decoded and cut into segments (see ``segmentation`` in ``transcribe``); each segment
becomes a piece (audio, prompt, token cap; see ``qasr.transcribe.pieces``), and all pieces go to the engine as
soon as they exist, so the segments of one long file are transcribed together. A bad input yields a
Transcription with ``error`` set; the other inputs in the same call still finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from qasr.engine.engine import Engine, EngineConfig
from qasr.engine.request import GenerationResult
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.prompt import ASR_TEXT_TAG, SUPPORTED_LANGUAGES, merge_languages, normalize_language
from qasr.results import Segment, Transcription, Word, worst_finish_reason
from qasr.transcribe.feed import stream_results
from qasr.transcribe.inputs import AudioInput, InputPieces, Segmenting, as_inputs, input_names, input_pieces
from qasr.transcribe.pieces import Piece, read_output
from qasr.transcribe.text import join_segment_texts
from qasr.transcribe.words import Aligned

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.audio.vad import VadConfig
    from qasr.streaming import Session
    from qasr.streaming.live import LiveSession

log = logging.getLogger(__name__)

Outcome = GenerationResult | Aligned | BaseException  # what became of one piece's request (Aligned: with words)

SEGMENTATIONS = ("auto", "vad", "fixed", "none")
TIMESTAMPS = ("segment", "word")


def check_options(max_new_tokens: int | None, segmentation: str, max_segment_s: float, timestamps: str) -> None:
    """The checks of a call's options that need no model: ``transcribe`` and the Ray job make them before any
    work starts (ValueError naming the option)."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {', '.join(SEGMENTATIONS)}, got {segmentation!r}")
    if not max_segment_s > 0:
        raise ValueError(f"max_segment_s must be positive, got {max_segment_s}")
    if timestamps not in TIMESTAMPS:
        raise ValueError(f"timestamps must be one of {', '.join(TIMESTAMPS)}, got {timestamps!r}")
_FINISH = {"eos": "stop", "length": "length"}  # the engine's words -> the OpenAI-style words we report
# a reason we do not know ranks worst; "malformed": the output lacked the <asr_text> tag


@dataclass(frozen=True)
class _Call:
    """One call's inputs with their names and per-input options, validated before any audio is touched."""

    items: list[AudioInput]
    names: list[str]  # how messages and results name each input
    languages: list[str | None]  # canonical names
    contexts: list[str]
    how: Segmenting
    words: bool  # word timestamps requested and an aligner loaded


class ASR:
    def __init__(self, checkpoint: Checkpoint, max_chunk_sec: float = 1200.0,
                 engine: EngineConfig | None = None, max_pending: int = 256,
                 max_tokens_per_second: float = 15.0, max_in_flight_s: float = 1800.0,
                 aligner: Aligner | None = None) -> None:
        """``max_chunk_sec``: the longest piece of an unsegmented input (``segmentation="none"``), cut
        at the quietest spot near each limit as the official package does. ``max_in_flight_s`` bounds the
        audio submitted and not yet transcribed by one ``transcribe``, ``transcribe_iter`` or
        ``transcribe_async`` call (memory for huge inputs and folders). ``max_pending`` is no longer used
        (it bounded ``transcribe_async`` by inputs, whatever their length); it is accepted so existing
        calls still work.
        ``max_tokens_per_second`` sets each piece's default generation cap from its duration (see
        ``prepare``), so a repetition loop stops early instead of running on. ``aligner`` (a
        ``qasr.Aligner``) gives ``transcribe(..., timestamps="word")`` its word times."""
        self.checkpoint = checkpoint
        self.max_chunk_sec = max_chunk_sec
        self.max_pending = max_pending
        self.max_in_flight_s = max_in_flight_s
        self.max_tokens_per_second = max_tokens_per_second
        self.engine = Engine(checkpoint, engine or EngineConfig())
        self.aligner = aligner
        self._release_idle_threads()  # this thread loaded the model (and the aligner)

    def _release_idle_threads(self) -> None:
        """Free the calling thread's idle OpenMP pool (engine/cpu/openmp.py). Any thread other than the
        engine's that ran torch owns one, and an idle pool anywhere makes every parallel region on the engine
        thread sleep and wake (measured 1.6x slower decode at the 0.6B dims). The engine does it for the
        threads that submit; the facade does it for the threads it runs torch on without submitting (the one
        that loaded the model, the ones that segment), so no front end has to know."""
        self.engine.prepared.release_caller_threads()

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "Qwen/Qwen3-ASR-0.6B", device: str = "auto",
                        dtype: str | torch.dtype = "auto", aligner: str | os.PathLike | Aligner | None = None,
                        **kwargs: object) -> ASR:
        """Load from a local directory or a hub id (local cache first); see ``ASR.__init__`` for kwargs.
        ``aligner``: a Qwen3-ForcedAligner directory or hub id (loaded with the same device and dtype), or
        a loaded ``qasr.Aligner``."""
        if aligner is not None and not hasattr(aligner, "submit_pieces"):
            from qasr.align.aligner import Aligner

            aligner = Aligner.from_pretrained(aligner, device=device, dtype=dtype)  # type: ignore[arg-type]
        return cls(load_checkpoint(model, device=device, dtype=dtype), aligner=aligner,  # type: ignore[arg-type]
                   **kwargs)

    @property
    def supported_languages(self) -> tuple[str, ...]:
        """The languages this checkpoint's config lists (all of Qwen3-ASR's when it lists none)."""
        return tuple(self.checkpoint.config.support_languages or SUPPORTED_LANGUAGES)

    def close(self) -> None:
        self.engine.close()
        if self.aligner is not None:
            self.aligner.close()

    def stream(self, **settings: object) -> Session:
        """A live transcription session (``qasr.streaming.Session``): ``push`` 16 kHz float32 or int16
        samples, read an ``Update`` per chunk, ``finish`` at the end. ``settings`` are those of
        ``qasr.streaming.StreamConfig`` (chunk_size_sec, unfixed_chunk_num, unfixed_token_num,
        max_new_tokens, context, language); see docs/streaming.md."""
        from qasr.streaming import Session, StreamConfig

        return Session(self.engine, self.checkpoint, StreamConfig(**settings))  # type: ignore[arg-type]

    def live(self, **settings: object) -> LiveSession:
        """A live session for a stream of any length (``qasr.streaming.LiveSession``): speech detection
        cuts it into turns, each streamed like ``stream()``; ``push`` returns events (speech started /
        stopped, updates with the newly stable text, each turn's final transcript). ``settings``: those of
        ``qasr.streaming.LiveConfig`` (turn_detection, silence_ms, max_turn_s, ...) and of
        ``StreamConfig`` (chunk_size_sec, language, ...), mixed; see docs/streaming.md."""
        from dataclasses import fields

        from qasr.streaming import LiveConfig, LiveSession, StreamConfig

        live_names = {f.name for f in fields(LiveConfig)} - {"stream"}
        live = {k: v for k, v in settings.items() if k in live_names}
        stream = StreamConfig(**{k: v for k, v in settings.items() if k not in live_names})  # type: ignore[arg-type]
        return LiveSession(self.engine, self.checkpoint, LiveConfig(stream=stream, **live))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ preparing requests
    def prepare(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                context: str | Sequence[str] = "", sample_rate: int | None = None,
                max_new_tokens: int | None = None, segmentation: str = "auto",
                max_segment_s: float = 30.0, vad: VadConfig | None = None) -> list[Piece]:
        """Decode and segment the inputs and return their pieces, ready for ``engine.submit``, in input order.

        Arguments are those of ``transcribe``. Each piece names its input (``source``, ``item``); a long
        input gives several. The default cap is ``ceil(max_tokens_per_second x seconds) + 24`` per
        piece, whatever the checkpoint's generation_config says; ``max_new_tokens`` replaces it.
        Unlike ``transcribe``, a bad input raises: AudioError (a ValueError) whose message starts with
        the input's name. ``assemble`` turns a piece list and its results into a Transcription.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens, segmentation, max_segment_s, vad)
        try:
            return [piece for i in range(len(call.items)) for piece in self._pieces_of(call, i)]
        finally:  # the server runs this on executor threads that live on (VAD and resampling ran torch here)
            self._release_idle_threads()

    def _call(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence,
              context: str | Sequence[str], sample_rate: int | None, max_new_tokens: int | None,
              segmentation: str, max_segment_s: float, vad: VadConfig | None, timestamps: str = "segment") -> _Call:
        items = as_inputs(audio)
        languages = [self.canonical_language(lang) for lang in _broadcast(language, len(items), "language")]
        contexts = [c or "" for c in _broadcast(context, len(items), "context")]
        check_options(max_new_tokens, segmentation, max_segment_s, timestamps)
        words = timestamps == "word"
        if words and self.aligner is None:
            log.warning("word timestamps need a forced aligner (ASR.from_pretrained(..., aligner=PATH), or "
                        "--aligner PATH): giving segment times instead")
            words = False
        how = Segmenting(sample_rate, segmentation, float(max_segment_s), vad, max_new_tokens,
                         self.max_tokens_per_second, self.max_chunk_sec)
        return _Call(items, input_names(items), languages, contexts, how, words)

    def canonical_language(self, lang: str | None) -> str | None:
        """The canonical name of a language name or ISO code (None for None or blank: detect).

        Raises ValueError listing the supported languages when this checkpoint does not list it."""
        name = normalize_language(lang)
        supported = self.supported_languages
        if name is not None and name not in supported:
            raise ValueError(f"language {lang!r} is not supported by this model; supported: {', '.join(supported)}")
        return name

    def _pieces_of(self, call: _Call, i: int) -> InputPieces:
        """Input ``i``'s pieces, decoded and segmented lazily; any failure is an AudioError naming the input."""
        return input_pieces(self.checkpoint, call.items[i], call.how, name=call.names[i], index=i,
                            context=call.contexts[i], language=call.languages[i])

    def submit(self, piece: Piece, words: bool = False, ignore_eos: bool = False,
               on_token: Callable[[int | None], None] | None = None) -> Future:
        """Queue one piece (from ``prepare``); the future's outcome is what ``assemble`` takes for it.

        ``words`` (with an aligner loaded) chains the piece's alignment onto its transcription: the future
        then resolves to an ``Aligned``. ``on_token`` is the engine's (each token, then None). Raises
        what ``engine.submit`` raises (ValueError for a piece the engine refuses); cancelling the future
        cancels the piece's requests."""
        fut = self.engine.submit(piece.prompt, waveform=piece.samples, max_new_tokens=piece.max_new_tokens,
                                 ignore_eos=ignore_eos, on_token=on_token)
        if words and self.aligner is not None:
            from qasr.transcribe.words import with_words

            return with_words(piece, fut, self.aligner, self.checkpoint.tokenizer)
        return fut

    def submit_or_refuse(self, piece: Piece, ignore_eos: bool = False, words: bool = False) -> Future:
        """``submit`` that never raises: a refusal at submit becomes the future's error, so a caller with
        many pieces handles every failure in one place."""
        try:
            return self.submit(piece, words=words, ignore_eos=ignore_eos)
        except Exception as exc:  # noqa: BLE001 - a refusal at submit is this input's error, like one later
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    # ------------------------------------------------------------------ transcribing
    def transcribe(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                   context: str | Sequence[str] = "", sample_rate: int | None = None,
                   max_new_tokens: int | None = None, ignore_eos: bool = False,
                   progress: Callable[[float], None] | None = None, segmentation: str = "auto",
                   max_segment_s: float = 30.0, vad: VadConfig | None = None,
                   timestamps: str = "segment") -> list[Transcription]:
        """Transcribe one input or a list; always returns one Transcription per input, in order.

        ``language`` forces the output language (a name or ISO code the checkpoint lists; None detects
        it); ``context`` is background text for the system turn. Scalars apply to every input, lists go
        item by item. ``sample_rate`` is needed for bare numpy arrays. ``max_new_tokens`` caps each
        piece (default: see ``prepare``); a piece cut at its cap has finish_reason "length" and logs a
        warning naming the input. ``ignore_eos`` forces exactly that many tokens (for benchmarks).

        ``segmentation``: "vad" cuts speech regions into segments of at most ``max_segment_s`` at the
        longest pauses and skips the silence between them (silence-only input gives an empty
        transcript); "fixed" cuts consecutive windows of ``max_segment_s``; "none" sends the input
        whole (cut only beyond ``max_chunk_sec``, as the official package does); "auto" (default) is
        "none" for inputs up to ``max_segment_s`` and "vad" for longer ones. ``progress`` is called
        with the audio seconds of each piece as it finishes. ``vad`` tunes the speech detector
        (``qasr.audio.vad.VadConfig``: backend, threshold, minimum speech and silence, padding).

        ``timestamps="word"`` fills each ``Segment.words`` from the forced aligner (see ``ASR.__init__``),
        spelled as in the text; without an aligner, or for a language it does not cover, a warning says
        so and segments keep their own times only. ``Transcription.timestamps`` records what was given.
        """
        results: list[Transcription | None] = [None] * len(as_inputs(audio))
        for i, result in self.transcribe_iter(audio, language=language, context=context, sample_rate=sample_rate,
                                              max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                              progress=progress, segmentation=segmentation,
                                              max_segment_s=max_segment_s, vad=vad, timestamps=timestamps):
            results[i] = result
        return results  # type: ignore[return-value]

    def transcribe_iter(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                        context: str | Sequence[str] = "", sample_rate: int | None = None,
                        max_new_tokens: int | None = None, ignore_eos: bool = False,
                        progress: Callable[[float], None] | None = None, segmentation: str = "auto",
                        max_segment_s: float = 30.0,
                        vad: VadConfig | None = None,
                        timestamps: str = "segment") -> Iterator[tuple[int, Transcription]]:
        """``transcribe``, yielding ``(input index, Transcription)`` as each input completes.

        Arguments are those of ``transcribe``. Inputs are decoded one after another on a background
        thread while the engine works; results come in completion order. Closing the iterator early (or
        Ctrl-C while it waits) cancels the unfinished requests and frees their KV cache.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens, segmentation, max_segment_s, vad,
                          timestamps)
        # requests are submitted from the decode thread, so the engine's own release never reaches this
        # one, which may have run torch since the model loaded
        self._release_idle_threads()
        yield from self._results(call, ignore_eos, progress)

    def _results(self, call: _Call, ignore_eos: bool, progress: Callable[[float], None] | None,
                 stop: threading.Event | None = None) -> Iterator[tuple[int, Transcription]]:
        """The pipeline behind transcribe_iter and transcribe_async: one decode thread, at most
        ``max_in_flight_s`` of audio submitted and unfinished; ``stop`` ends it from another thread."""
        warn = not ignore_eos

        def finish(i: int, pieces: list[Piece], futures: list[Future], duration: float) -> Transcription:
            return self._assemble(pieces, [_outcome(f) for f in futures], warn=warn, duration=duration,
                                  source=call.names[i], words=call.words)

        def fail(i: int, message: str) -> Transcription:
            return _failed(call.names[i], message)

        results = stream_results(len(call.items), pieces_of=lambda i: self._pieces_of(call, i),
                                 submit=lambda piece: self.submit_or_refuse(piece, ignore_eos, call.words),
                                 finish=finish, fail=fail, max_in_flight_s=self.max_in_flight_s,
                                 progress=progress, stop=stop)
        yield from results  # type: ignore[misc]

    async def transcribe_async(self, audio: AudioInput | Sequence[AudioInput],
                               language: str | None | Sequence = None, context: str | Sequence[str] = "",
                               sample_rate: int | None = None, max_new_tokens: int | None = None,
                               ignore_eos: bool = False, progress: Callable[[float], None] | None = None,
                               segmentation: str = "auto", max_segment_s: float = 30.0,
                               vad: VadConfig | None = None, timestamps: str = "segment") -> list[Transcription]:
        """``transcribe`` for asyncio: same arguments, same results, the event loop never blocks.

        The inputs go through ``transcribe``'s own pipeline, on a thread of this call's: one input decoded
        at a time, and at most ``max_in_flight_s`` seconds of audio submitted and not yet transcribed, so a
        long file or a long list never sits in memory at once. Cancelling the awaiting task cancels its
        engine requests (before the cancellation reaches the caller). ``progress`` runs on the event loop.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens, segmentation, max_segment_s, vad,
                          timestamps)
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[list[Transcription]] = loop.create_future()
        stop = threading.Event()
        tick = None if progress is None else (lambda seconds: loop.call_soon_threadsafe(progress, seconds))

        def run() -> None:
            results: list[Transcription | None] = [None] * len(call.items)
            try:
                for i, result in self._results(call, ignore_eos, tick, stop):
                    results[i] = result
                settle = (_resolve, outcome, results)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which raises it
                settle = (_reject, outcome, exc)
            try:
                loop.call_soon_threadsafe(*settle)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        threading.Thread(target=run, name="qasr-async", daemon=True).start()
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({outcome})  # the pipeline has cancelled its requests once it settles this
            raise

    # ------------------------------------------------------------------ results
    def assemble(self, pieces: Sequence[Piece], results: Sequence[Outcome]) -> Transcription:
        """One input's Transcription from its pieces (as ``prepare`` gave them) and their engine results.

        ``results[k]`` is piece k's GenerationResult, or the exception its request ended with (which
        makes the whole input fail, as in ``transcribe``). The duration is taken as the end of the last
        piece (``transcribe`` knows the input's own, which can be longer when it ends in silence).
        Outcomes from ``submit(..., words=True)`` (``Aligned``) give word timestamps, as in ``transcribe``.
        """
        words = any(isinstance(r, Aligned) for r in results)  # words were asked for these pieces
        return self._assemble(list(pieces), list(results), warn=True, words=words)

    def _assemble(self, pieces: list[Piece], outcomes: list[Outcome], warn: bool, duration: float | None = None,
                  source: str | None = None, words: bool = False) -> Transcription:
        if len(pieces) != len(outcomes) or not (pieces or source is not None):
            raise ValueError(f"need one result per piece, got {len(outcomes)} for {len(pieces)} pieces")
        if len({(p.item, p.source) for p in pieces}) > 1:
            raise ValueError("these pieces come from several inputs; assemble one input's pieces at a time")
        source = pieces[0].source if pieces else source
        assert source is not None
        if duration is None:
            duration = max(p.offset + p.duration for p in pieces)
        tok = self.checkpoint.tokenizer
        langs, raws, ids, segments, notes = [], [], [], [], []
        for piece, out in sorted(zip(pieces, outcomes, strict=True), key=lambda po: po[0].offset):
            timed: tuple[Word, ...] = ()
            if isinstance(out, Aligned):
                timed = out.words
                if out.note:
                    notes.append(f"{piece.offset:.1f} s: {out.note}")
                out = out.result
            if not isinstance(out, GenerationResult):
                why = "request cancelled" if isinstance(out, (CancelledError, asyncio.CancelledError)) else str(out)
                return Transcription("", "", duration, error=f"{source}: {why}", source=source)
            raw = tok.decode(out.token_ids, skip_special_tokens=True)
            lang, text, malformed = read_output(raw, piece)
            reason = _FINISH.get(out.finish_reason, out.finish_reason)
            if malformed and reason != "length":
                reason = "malformed"
                if warn:
                    log.warning("%s: the piece at %.1f s gave no transcript: the model's output %r lacks "
                                "the %s tag", source, piece.offset, raw[:60], ASR_TEXT_TAG)
            if reason == "length" and warn:
                log.warning("%s: the piece at %.1f s was cut at max_new_tokens=%d; its text may be incomplete",
                            source, piece.offset, piece.max_new_tokens)
            langs.append(lang)
            raws.append(raw)
            ids += out.token_ids
            segments.append(Segment(round(piece.offset, 3), round(piece.offset + piece.duration, 3), text,
                                    words=timed, finish_reason=reason))
        worst = worst_finish_reason(s.finish_reason for s in segments)
        # word times only when every segment with text has them: a mix would mislead a subtitle writer
        all_timed = words and all(s.words for s in segments if s.text)
        if words and not all_timed and warn:
            log.warning("%s: word timestamps unavailable, giving segment times (%s)", source,
                        "; ".join(notes) or "the aligner returned no words")
        if words and not all_timed:
            segments = [replace(s, words=()) for s in segments]
        return Transcription(text=join_segment_texts(s.text for s in segments), language=merge_languages(langs),
                             duration=round(duration, 3), raw="".join(raws), token_ids=tuple(ids),
                             segments=tuple(segments), source=source, finish_reason=worst,
                             timestamps="word" if all_timed else "segment")


def _resolve(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _outcome(fut: Future | asyncio.Future) -> Outcome:
    """The future's result or its error (waiting for it when it is a pending concurrent future)."""
    try:
        return fut.result()
    except (Exception, asyncio.CancelledError) as exc:  # asyncio's CancelledError is a BaseException
        return exc


def _failed(source: str, error: str) -> Transcription:
    return Transcription("", "", 0.0, error=error, source=source)


def _broadcast(value: object, n: int, what: str) -> list:
    if value is None or isinstance(value, str):
        return [value] * n
    values = list(value)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"{what}: got {len(values)} values for {n} inputs")
    return values
