"""The checkpoint, engine and aligner under the facade, driven piece by piece by the server and Ray."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.model.checkpoint import Checkpoint
from qasr.model.prompt import SUPPORTED_LANGUAGES
from qasr.results import Segment, Transcription
from qasr.transcribe.assemble import Outcome, assemble, failed, outcome_of, read_piece
from qasr.transcribe.feed import run_inputs
from qasr.transcribe.inputs import AudioInput, Call, canonical_language, plan_call
from qasr.transcribe.options import TranscribeOptions
from qasr.transcribe.pieces import Piece
from qasr.transcribe.words import Aligned, WordChain

if TYPE_CHECKING:
    from qasr.align.aligner import Aligner
    from qasr.engine_process.client import RemoteEngine
    from qasr.streaming.live import OpenTurn


class Core:
    """``max_chunk_sec``: the longest unsegmented piece; ``max_in_flight_*``: what one call has submitted and
    not finished."""

    def __init__(self, checkpoint: Checkpoint, engine: EngineConfig | Engine | RemoteEngine | None = None,
                 aligner: Aligner | None = None, max_chunk_sec: float = 1200.0, max_tokens_per_second: float = 15.0,
                 max_in_flight_s: float = 1800.0, max_in_flight_pieces: int | None = None,
                 open_turn: OpenTurn | None = None) -> None:
        """``engine``: a config (an Engine is made of it) or an engine already running; ``open_turn``: how a
        live session's turn starts (default: a Session on the engine)."""
        self.checkpoint = checkpoint
        if engine is None or isinstance(engine, EngineConfig):
            engine = Engine(checkpoint, engine or EngineConfig())
        self.engine = engine
        self.open_turn = open_turn
        # pieces bring their log-mel, made where they are prepared: never on the engine's or the event loop's
        # thread (None: the device makes it, inside the step)
        self.log_mel = self.engine.log_mel
        self.aligner = aligner
        self.words = None if aligner is None else WordChain(aligner, checkpoint.tokenizer)
        self.max_chunk_sec = max_chunk_sec
        self.max_tokens_per_second = max_tokens_per_second
        self.max_in_flight_s = max_in_flight_s
        running = self.engine.config.max_running
        self.max_in_flight_pieces = max_in_flight_pieces or running + max(2, running // 4)
        self.release_idle_threads()  # this thread loaded the model

    @property
    def supported_languages(self) -> tuple[str, ...]:
        return tuple(self.checkpoint.config.support_languages or SUPPORTED_LANGUAGES)

    def release_idle_threads(self) -> None:
        """Free this thread's idle OpenMP pool, which slows the engine's (engine/cpu/openmp.py)."""
        self.engine.release_caller_threads()

    def close(self) -> None:
        self.engine.close()  # its last pieces are handed to the word chain,
        if self.words is not None:
            self.words.close()  # which submits their alignments before the aligner drains
        if self.aligner is not None:
            self.aligner.close()

    def canonical_language(self, lang: str | None) -> str | None:
        """A language's canonical name (None: detect); ValueError when the model lacks it."""
        return canonical_language(lang, self.supported_languages)

    def plan(self, audio: AudioInput | Sequence[AudioInput], options: TranscribeOptions) -> Call:
        return plan_call(self.checkpoint, audio, options.for_model(self.checkpoint.config),
                         supported=self.supported_languages, aligner=self.aligner is not None,
                         tokens_per_second=self.max_tokens_per_second, max_chunk_sec=self.max_chunk_sec,
                         log_mel=self.log_mel)

    def prepare(self, audio: AudioInput | Sequence[AudioInput],
                options: TranscribeOptions | None = None) -> list[Piece]:
        """The inputs' pieces, in order, as ``transcribe`` submits them (their log-mel made on this thread);
        AudioError names a bad input."""
        call = self.plan(audio, options or TranscribeOptions())
        try:
            return [piece for i in range(len(call.items)) for piece in call.pieces_of(i)]
        finally:  # the server's executor threads live on
            self.release_idle_threads()

    def submit(self, piece: Piece, words: bool = False, ignore_eos: bool = False,
               on_token: Callable[[int | None], None] | None = None, group: Hashable | None = None,
               lead: bool = False) -> Future:
        """Queue a piece (``words``: and its alignment) as ``Engine.submit`` does; ``assemble`` takes the outcome.
        ``lead``: its text is streamed, so its group's other pieces wait while it runs (``RequestSpec.lead``)."""
        audio = {"waveform": piece.samples} if piece.features is None else {"features": piece.features}
        fut = self.engine.submit(RequestSpec(piece.prompt, piece.max_new_tokens, ignore_eos=ignore_eos, group=group,
                                             lead=lead, **audio), on_token=on_token)
        if words and self.words is not None:
            return self.words.with_words(replace(piece, features=None), fut)  # the engine drops them once encoded
        return fut

    def submit_or_refuse(self, piece: Piece, ignore_eos: bool = False, words: bool = False,
                         group: Hashable | None = None, lead: bool = False) -> Future:
        """``submit`` whose refusal becomes the future's error."""
        try:
            return self.submit(piece, words=words, ignore_eos=ignore_eos, group=group, lead=lead)
        except Exception as exc:  # noqa: BLE001 - this input's error
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    def assemble(self, pieces: Sequence[Piece], results: Sequence[Outcome]) -> Transcription:
        """One input's Transcription from its pieces and their outcomes."""
        words = any(isinstance(r, Aligned) for r in results)
        return assemble(self.checkpoint.tokenizer, pieces, results, warn=True, words=words)

    def results(self, call: Call, progress: Callable[[float], None] | None, stop: threading.Event | None = None,
                segments: bool = False) -> Iterator[tuple[int, Transcription | Segment]]:
        """``ASR.transcribe_iter``'s results; ``stop`` ends them from another thread."""
        ignore_eos = call.options.ignore_eos
        tok = self.checkpoint.tokenizer

        def segment(i: int, piece: Piece, fut: Future) -> Segment | None:
            read = read_piece(tok, piece, outcome_of(fut), call.names[i], warn=False)  # assemble warns, once
            return None if isinstance(read, str) else read.segment

        def finish(i: int, pieces: list[Piece], futures: list[Future], duration: float) -> Transcription:
            return assemble(tok, pieces, [outcome_of(f) for f in futures], warn=not ignore_eos,
                            duration=duration, source=call.names[i], words=call.words)

        group = object()  # the call's share of the engine's admission
        leads = itertools.chain([segments], itertools.repeat(False))  # streamed segments: the first one leads
        results = run_inputs(len(call.items), pieces_of=call.pieces_of,
                             submit=lambda piece: self.submit_or_refuse(piece, ignore_eos, call.words, group,
                                                                        lead=next(leads)),
                             finish=finish, fail=lambda i, message: failed(call.names[i], message),
                             max_in_flight_s=self.max_in_flight_s, max_in_flight_pieces=self.max_in_flight_pieces,
                             progress=progress, stop=stop, piece_done=segment if segments else None,
                             idle=self.release_idle_threads)
        try:
            for i, item in results:
                if item is not None:  # a failed piece has no segment
                    yield i, item
        finally:
            results.close()  # cancels the unfinished requests
