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
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from qasr.engine.config import quantize_option
from qasr.engine.engine import Engine, EngineConfig
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.prompt import SUPPORTED_LANGUAGES
from qasr.results import Segment, Transcription
from qasr.transcribe.assemble import Outcome, assemble, failed, outcome_of, read_piece
from qasr.transcribe.feed import stream_results
from qasr.transcribe.inputs import (
    SEGMENTATIONS,
    TIMESTAMPS,
    AudioInput,
    Call,
    Segmenting,
    as_inputs,
    canonical_language,
    check_options,
    plan_call,
)
from qasr.transcribe.pieces import Piece
from qasr.transcribe.segment_stream import SegmentStream
from qasr.transcribe.words import Aligned

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.audio.vad import VadConfig
    from qasr.streaming import Session
    from qasr.streaming.live import LiveSession

log = logging.getLogger(__name__)
# re-exported: qasr.api and callers import these from here
__all__ = ["ASR", "SEGMENTATIONS", "TIMESTAMPS", "AudioInput", "Outcome", "check_options"]


class ASR:
    def __init__(self, checkpoint: Checkpoint, max_chunk_sec: float = 1200.0,
                 engine: EngineConfig | None = None, max_pending: int = 256,
                 max_tokens_per_second: float = 15.0, max_in_flight_s: float = 1800.0,
                 aligner: Aligner | None = None, max_in_flight_pieces: int | None = None) -> None:
        """``max_chunk_sec``: the longest piece of an unsegmented input (``segmentation="none"``), cut
        at the quietest spot near each limit as the official package does. ``max_in_flight_s`` bounds the
        audio submitted and not yet transcribed by one ``transcribe``, ``transcribe_iter`` or
        ``transcribe_async`` call (memory for huge inputs and folders); ``max_in_flight_pieces`` bounds its
        pieces (default: the engine's ``max_running`` and a quarter more, which keeps the engine's batch
        full; see ``qasr.transcribe.feed`` for why no more). ``max_pending`` is no longer used
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
        running = self.engine.config.max_running
        # a quarter more than the engine runs: a finished piece's slot is refilled at once from the queue
        self.max_in_flight_pieces = max_in_flight_pieces or running + max(2, running // 4)
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
                        quantize: str | None = None, **kwargs: object) -> ASR:
        """Load from a local directory or a hub id (local cache first); see ``ASR.__init__`` for kwargs.
        ``aligner``: a Qwen3-ForcedAligner directory or hub id (loaded with the same device and dtype), or
        a loaded ``qasr.Aligner``. ``quantize="int8"`` runs the ASR model's linears and encoder convolutions
        in int8, ``"int4"`` the same with int4 decoder weights (CPU only; docs/quantization.md; ``None`` or
        ``"none"``: off, the default); it sets the
        ``quantize`` of ``engine=EngineConfig(...)`` when both are given. An aligner keeps its own dtype."""
        mode = quantize_option(quantize)  # a bad value fails before anything loads
        if mode is not None:
            kwargs["engine"] = replace(kwargs.get("engine") or EngineConfig(), quantize=mode)  # type: ignore[type-var]
        if aligner is not None and not hasattr(aligner, "submit_pieces"):
            from qasr.align.aligner import Aligner

            aligner = Aligner.from_pretrained(aligner, device=device, dtype=dtype)  # type: ignore[arg-type]
        return cls(load_checkpoint(model, device=device, dtype=dtype), aligner=aligner,  # type: ignore[arg-type]
                   **kwargs)

    @property
    def supported_languages(self) -> tuple[str, ...]:
        """The languages this checkpoint's config lists (all of Qwen3-ASR's when it lists none)."""
        return tuple(self.checkpoint.config.support_languages or SUPPORTED_LANGUAGES)

    @property
    def max_segment_s(self) -> float:
        """The longest segment when a call names none: what the checkpoint's config.json declares
        (``"qasr": {"max_segment_s": S}``), else 30 s (docs/segmentation.md)."""
        return self.checkpoint.config.max_segment_s

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
                max_segment_s: float | None = None, vad: VadConfig | None = None) -> list[Piece]:
        """Decode and segment the inputs and return their pieces, ready for ``engine.submit``, in input order.

        Arguments are those of ``transcribe``. Each piece names its input (``source``, ``item``); a long
        input gives several. The default cap is ``ceil(max_tokens_per_second x seconds) + 24`` per
        piece, whatever the checkpoint's generation_config says; ``max_new_tokens`` replaces it.
        Unlike ``transcribe``, a bad input raises: AudioError (a ValueError) whose message starts with
        the input's name. ``assemble`` turns a piece list and its results into a Transcription.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens, segmentation, max_segment_s, vad)
        try:
            return [piece for i in range(len(call.items)) for piece in call.pieces_of(i)]
        finally:  # the server runs this on executor threads that live on (VAD and resampling ran torch here)
            self._release_idle_threads()

    def _call(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence,
              context: str | Sequence[str], sample_rate: int | None, max_new_tokens: int | None,
              segmentation: str, max_segment_s: float | None, vad: VadConfig | None,
              timestamps: str = "segment") -> Call:
        """Every call's plan; the one place a call's ``max_segment_s=None`` becomes the model's own."""
        if max_segment_s is None:
            max_segment_s = self.max_segment_s
        how = Segmenting(sample_rate, segmentation, float(max_segment_s), vad, max_new_tokens,
                         self.max_tokens_per_second, self.max_chunk_sec)
        return plan_call(self.checkpoint, audio, language=language, context=context, how=how, timestamps=timestamps,
                         supported=self.supported_languages, aligner=self.aligner is not None)

    def canonical_language(self, lang: str | None) -> str | None:
        """The canonical name of a language name or ISO code (None for None or blank: detect).

        Raises ValueError listing the supported languages when this checkpoint does not list it."""
        return canonical_language(lang, self.supported_languages)

    def submit(self, piece: Piece, words: bool = False, ignore_eos: bool = False,
               on_token: Callable[[int | None], None] | None = None, group: Hashable | None = None) -> Future:
        """Queue one piece (from ``prepare``); the future's outcome is what ``assemble`` takes for it.

        ``words`` (with an aligner loaded) chains the piece's alignment onto its transcription: the future
        then resolves to an ``Aligned``. ``on_token`` is the engine's (each token, then None). Raises
        what ``engine.submit`` raises (ValueError for a piece the engine refuses); cancelling the future
        cancels the piece's requests. ``group``: the engine's share of the running set (``Engine.submit``);
        give the pieces of one call the same one, so that a long file does not hold back other callers."""
        fut = self.engine.submit(piece.prompt, waveform=piece.samples, max_new_tokens=piece.max_new_tokens,
                                 ignore_eos=ignore_eos, on_token=on_token, group=group)
        if words and self.aligner is not None:
            from qasr.transcribe.words import with_words

            return with_words(piece, fut, self.aligner, self.checkpoint.tokenizer)
        return fut

    def submit_or_refuse(self, piece: Piece, ignore_eos: bool = False, words: bool = False,
                         group: Hashable | None = None) -> Future:
        """``submit`` that never raises: a refusal at submit becomes the future's error, so a caller with
        many pieces handles every failure in one place."""
        try:
            return self.submit(piece, words=words, ignore_eos=ignore_eos, group=group)
        except Exception as exc:  # noqa: BLE001 - a refusal at submit is this input's error, like one later
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    # ------------------------------------------------------------------ transcribing
    def transcribe(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                   context: str | Sequence[str] = "", sample_rate: int | None = None,
                   max_new_tokens: int | None = None, ignore_eos: bool = False,
                   progress: Callable[[float], None] | None = None, segmentation: str = "auto",
                   max_segment_s: float | None = None, vad: VadConfig | None = None,
                   timestamps: str = "segment") -> list[Transcription]:
        """Transcribe one input or a list; always returns one Transcription per input, in order.

        ``language`` forces the output language (a name or ISO code the checkpoint lists; None detects
        it); ``context`` is background text for the system turn. Scalars apply to every input, lists go
        item by item. ``sample_rate`` is needed for bare numpy arrays. ``max_new_tokens`` caps each
        piece (default: see ``prepare``); a piece cut at its cap has finish_reason "length" and logs a
        warning naming the input. ``ignore_eos`` forces exactly that many tokens (for benchmarks).

        ``segmentation``: "vad" cuts speech regions into segments of at most ``max_segment_s`` seconds
        (default ``ASR.max_segment_s``: the model's declared preference, else 30) at the longest pauses
        and skips the silence between them (silence-only input gives an empty transcript); "fixed" cuts
        consecutive windows of ``max_segment_s``; "none" sends the input whole (cut only beyond
        ``max_chunk_sec``, as the official package does); "auto" (default) is "none" for inputs up to
        ``max_segment_s`` and "vad" for longer ones. ``progress`` is called with the audio seconds of each
        piece as it finishes. ``vad`` tunes the speech detector (``qasr.audio.vad.VadConfig``: backend,
        threshold, minimum speech and silence, padding).

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
                        max_segment_s: float | None = None,
                        vad: VadConfig | None = None,
                        timestamps: str = "segment",
                        segments: bool = False) -> Iterator[tuple[int, Transcription | Segment]]:
        """``transcribe``, yielding ``(input index, Transcription)`` as each input completes.

        Arguments are those of ``transcribe``. Inputs are decoded one after another on a background
        thread while the engine works; results come in completion order. Closing the iterator early (or
        Ctrl-C while it waits) cancels the unfinished requests and frees their KV cache.

        ``segments=True`` also yields ``(input index, Segment)`` for each segment of an input, in time
        order, as soon as it and every segment before it are transcribed (the later ones run meanwhile),
        and then the input's Transcription, whose segments are those. A failed input stops its segments
        there; its Transcription carries the error. For one input, ``transcribe_segments`` is simpler.
        """
        call = self._call(audio, language, context, sample_rate, max_new_tokens, segmentation, max_segment_s, vad,
                          timestamps)
        # requests are submitted from the decode thread, so the engine's own release never reaches this
        # one, which may have run torch since the model loaded
        self._release_idle_threads()
        yield from self._results(call, ignore_eos, progress, segments=segments)

    def transcribe_segments(self, audio: AudioInput, language: str | None = None, context: str = "",
                            sample_rate: int | None = None, max_new_tokens: int | None = None,
                            ignore_eos: bool = False, progress: Callable[[float], None] | None = None,
                            segmentation: str = "auto", max_segment_s: float | None = None,
                            vad: VadConfig | None = None, timestamps: str = "segment") -> SegmentStream:
        """One input's segments, in time order, each as soon as it and every one before it are done:

            for segment in asr.transcribe_segments("talk.mp3"):
                print(f"[{segment.start:.1f} -> {segment.end:.1f}] {segment.text}")

        Arguments are those of ``transcribe``, for a single input. The segments of a long file are still
        transcribed together; this only hands each one over as early as its order allows. The returned
        ``SegmentStream`` holds the whole Transcription in ``.transcription`` once exhausted, and raises
        ``TranscriptionFailed`` at the end if the input failed. Nothing runs until it is iterated."""
        if len(as_inputs(audio)) != 1:
            raise ValueError("transcribe_segments takes one input; use transcribe_iter(..., segments=True) "
                             "for several")
        return SegmentStream(self.transcribe_iter(
            audio, language=language, context=context, sample_rate=sample_rate, max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos, progress=progress, segmentation=segmentation, max_segment_s=max_segment_s,
            vad=vad, timestamps=timestamps, segments=True))

    def _results(self, call: Call, ignore_eos: bool, progress: Callable[[float], None] | None,
                 stop: threading.Event | None = None, segments: bool = False) -> Iterator[tuple[int, object]]:
        """The pipeline behind transcribe_iter and transcribe_async: one decode thread, at most
        ``max_in_flight_s`` of audio and ``max_in_flight_pieces`` pieces submitted and unfinished;
        ``stop`` ends it from another thread.
        ``segments``: also each input's segments in order, as they are ready (``transcribe_iter``)."""
        warn = not ignore_eos
        tok = self.checkpoint.tokenizer

        def segment(i: int, piece: Piece, fut: Future) -> Segment | None:
            read = read_piece(tok, piece, outcome_of(fut), call.names[i], warn=False)  # assemble warns, once
            return None if isinstance(read, str) else read.segment

        def finish(i: int, pieces: list[Piece], futures: list[Future], duration: float) -> Transcription:
            return assemble(tok, pieces, [outcome_of(f) for f in futures], warn=warn,
                            duration=duration, source=call.names[i], words=call.words)

        def fail(i: int, message: str) -> Transcription:
            return failed(call.names[i], message)

        group = object()  # this call's pieces share one place in the engine's admission (Engine.submit)
        results = stream_results(len(call.items), pieces_of=call.pieces_of,
                                 submit=lambda piece: self.submit_or_refuse(piece, ignore_eos, call.words, group),
                                 finish=finish, fail=fail, max_in_flight_s=self.max_in_flight_s,
                                 max_in_flight_pieces=self.max_in_flight_pieces,
                                 progress=progress, stop=stop, piece_done=segment if segments else None,
                                 idle=self._release_idle_threads)
        try:
            for i, item in results:
                if item is not None:  # a failed piece has no segment: its input's Transcription says why
                    yield i, item
        finally:
            results.close()  # an early exit here cancels the unfinished requests at once

    async def transcribe_async(self, audio: AudioInput | Sequence[AudioInput],
                               language: str | None | Sequence = None, context: str | Sequence[str] = "",
                               sample_rate: int | None = None, max_new_tokens: int | None = None,
                               ignore_eos: bool = False, progress: Callable[[float], None] | None = None,
                               segmentation: str = "auto", max_segment_s: float | None = None,
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
        return assemble(self.checkpoint.tokenizer, pieces, results, warn=True, words=words)


def _resolve(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
