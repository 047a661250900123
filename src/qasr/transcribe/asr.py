"""The ASR facade: load a checkpoint once, transcribe files, bytes or arrays."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from qasr.engine.config import quantize_option
from qasr.engine.engine import EngineConfig
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.results import Segment, Transcription
from qasr.transcribe.core import Core
from qasr.transcribe.inputs import AudioInput, as_inputs
from qasr.transcribe.options import TranscribeOptions

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.streaming import LiveConfig, LiveSession, Session, StreamConfig
    from qasr.streaming.live import Turn

Progress = Callable[[float], None]  # audio seconds done


class ASR:
    """``options`` (``qasr.TranscribeOptions``) say how a call transcribes; its keywords, when not None,
    replace the options' own."""

    def __init__(self, checkpoint: Checkpoint, engine: EngineConfig | None = None, aligner: Aligner | None = None,
                 max_chunk_sec: float = 1200.0, max_tokens_per_second: float = 15.0,
                 max_in_flight_s: float = 1800.0, max_in_flight_pieces: int | None = None, *,
                 core: Core | None = None) -> None:
        """``core``: a Core built already (the server's, over an engine process); the other arguments are then
        ignored."""
        self._core = core or Core(checkpoint, engine, aligner, max_chunk_sec=max_chunk_sec,
                                  max_tokens_per_second=max_tokens_per_second, max_in_flight_s=max_in_flight_s,
                                  max_in_flight_pieces=max_in_flight_pieces)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "Qwen/Qwen3-ASR-0.6B", device: str = "auto",
                        dtype: str | torch.dtype = "auto", aligner: str | os.PathLike | Aligner | None = None,
                        quantize: str | None = None, threads: int | None = None, **kwargs: object) -> ASR:
        """Load from a directory or hub id; ``aligner`` (path, hub id or ``qasr.Aligner``) times words;
        ``quantize``: "int8", "int4" (CPU only) or None; ``threads``: the engines' CPU threads (default:
        torch's count, at most the CPUs this process may use)."""
        mode = quantize_option(quantize)  # a bad value fails before anything loads
        engine = kwargs.get("engine") or EngineConfig()
        if mode is not None:
            engine = replace(engine, quantize=mode)
        if threads is not None:
            engine = replace(engine, threads=threads)
        kwargs["engine"] = engine
        if aligner is not None and not hasattr(aligner, "submit_pieces"):
            from qasr.align.aligner import Aligner

            aligner = Aligner.from_pretrained(aligner, device=device, dtype=dtype,
                                              engine_config=EngineConfig(threads=engine.threads))
        return cls(load_checkpoint(model, device=device, dtype=dtype), aligner=aligner,
                   **kwargs)

    @property
    def supported_languages(self) -> tuple[str, ...]:
        """The languages this checkpoint lists."""
        return self._core.supported_languages

    @property
    def max_segment_s(self) -> float:
        """The longest segment when the options name none: the checkpoint's, else 30 s."""
        return self._core.checkpoint.config.max_segment_s

    def close(self) -> None:
        self._core.close()

    def stream(self, config: StreamConfig | None = None) -> Session | Turn:
        """A live transcription session for one turn (``qasr.streaming.Session``): ``push`` 16 kHz float32
        or int16 samples, read an ``Update`` per chunk, ``finish`` at the end; see docs/streaming.md. (Over
        an engine process, a turn run there: push, finish and close.)"""
        from qasr.streaming import Session, StreamConfig

        if self._core.open_turn is not None:
            return self._core.open_turn(config or StreamConfig())
        return Session(self._core.engine, self._core.checkpoint, config)

    def live(self, config: LiveConfig | None = None) -> LiveSession:
        """A live session for a stream of any length (``qasr.streaming.LiveSession``): speech detection
        cuts it into turns, each streamed like ``stream()``; ``push`` returns events (speech started /
        stopped, updates with the newly stable text, each turn's final transcript)."""
        from qasr.streaming import LiveSession

        return LiveSession(self._core.engine, self._core.checkpoint, config, open_turn=self._core.open_turn)

    def transcribe(self, audio: AudioInput | Sequence[AudioInput], options: TranscribeOptions | None = None, *,
                   language: str | Sequence[str | None] | None = None, context: str | Sequence[str] | None = None,
                   max_new_tokens: int | None = None, timestamps: str | None = None,
                   progress: Progress | None = None) -> list[Transcription]:
        """One Transcription per input, in order; ``audio`` is one input or a list."""
        results: list[Transcription | None] = [None] * len(as_inputs(audio))
        for i, result in self.transcribe_iter(audio, options, language=language, context=context,
                                              max_new_tokens=max_new_tokens, timestamps=timestamps,
                                              progress=progress):
            results[i] = result
        return results

    def transcribe_iter(self, audio: AudioInput | Sequence[AudioInput], options: TranscribeOptions | None = None, *,
                        language: str | Sequence[str | None] | None = None,
                        context: str | Sequence[str] | None = None, max_new_tokens: int | None = None,
                        timestamps: str | None = None, progress: Progress | None = None,
                        segments: bool = False) -> Iterator[tuple[int, Transcription | Segment]]:
        """``(input index, Transcription)`` as each input completes (``segments``: each ``Segment`` too, in
        order); closing it early cancels the rest."""
        call = self._core.plan(audio, _given(options, language, context, max_new_tokens, timestamps))
        self._core.release_idle_threads()  # this thread may have run torch
        yield from self._core.results(call, progress, segments=segments)

    def transcribe_segments(self, audio: AudioInput, options: TranscribeOptions | None = None, *,
                            language: str | None = None, context: str | None = None,
                            max_new_tokens: int | None = None, timestamps: str | None = None,
                            progress: Progress | None = None) -> SegmentIterator:
        """One input's segments in order, each as soon as it and those before it are done."""
        if len(as_inputs(audio)) != 1:
            raise ValueError("transcribe_segments takes one input; use transcribe_iter(..., segments=True) "
                             "for several")
        return SegmentIterator(self.transcribe_iter(
            audio, options, language=language, context=context, max_new_tokens=max_new_tokens,
            timestamps=timestamps, progress=progress, segments=True))

    async def transcribe_async(self, audio: AudioInput | Sequence[AudioInput], options: TranscribeOptions | None = None,
                               *, language: str | Sequence[str | None] | None = None,
                               context: str | Sequence[str] | None = None, max_new_tokens: int | None = None,
                               timestamps: str | None = None, progress: Progress | None = None) -> list[Transcription]:
        """``transcribe`` for asyncio (``progress`` runs on the loop); cancelling it cancels its requests."""
        call = self._core.plan(audio, _given(options, language, context, max_new_tokens, timestamps))
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[list[Transcription]] = loop.create_future()
        stop = threading.Event()
        tick = None if progress is None else (lambda seconds: loop.call_soon_threadsafe(progress, seconds))

        def run() -> None:
            results: list[Transcription | None] = [None] * len(call.items)
            try:
                for i, result in self._core.results(call, tick, stop):
                    results[i] = result
                settle = (_resolve, outcome, results)
            except BaseException as exc:  # noqa: BLE001 - the awaiting task raises it
                settle = (_reject, outcome, exc)
            try:
                loop.call_soon_threadsafe(*settle)
            except RuntimeError:  # the loop is closed: nobody waits
                pass

        threading.Thread(target=run, name="qasr-async", daemon=True).start()
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({outcome})  # once its requests are cancelled
            raise


def _given(options: TranscribeOptions | None, language: object, context: object, max_new_tokens: int | None,
           timestamps: str | None) -> TranscribeOptions:
    return (options or TranscribeOptions()).given(language=language, context=context, max_new_tokens=max_new_tokens,
                                                  timestamps=timestamps)


class TranscriptionFailed(RuntimeError):
    """An input failed; ``transcription`` holds the error."""

    def __init__(self, transcription: Transcription) -> None:
        super().__init__(transcription.error)
        self.transcription = transcription


class SegmentIterator:
    """One input's ``Segment``s in order; then ``transcription`` holds it (or ``TranscriptionFailed``)."""

    def __init__(self, events: Iterator[tuple[int, object]]) -> None:
        self._events = events
        self.transcription: Transcription | None = None

    def __iter__(self) -> Iterator[Segment]:
        for _, item in self._events:
            if isinstance(item, Segment):
                yield item
            elif isinstance(item, Transcription):
                self.transcription = item
                if item.error is not None:
                    raise TranscriptionFailed(item)

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> SegmentIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
