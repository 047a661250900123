"""The ASR facade: load a checkpoint once, transcribe files, bytes or arrays.

Every input is decoded, split when longer than ``max_chunk_sec``, turned into per-utterance
features and a prompt, and sent through greedy generation. A bad input yields a Transcription with
``error`` set; the other inputs in the same call still finish.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.audio.io import SAMPLE_RATE, AudioError, load_audio
from qasr.audio.split import split_long_audio
from qasr.engine.engine import Engine, EngineConfig
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.config import audio_token_count
from qasr.model.prompt import (
    SUPPORTED_LANGUAGES,
    build_prompt,
    merge_languages,
    normalize_language,
    parse_asr_output,
)
from qasr.results import Segment, Transcription

AudioInput = str | os.PathLike | bytes | np.ndarray | tuple


@dataclass(frozen=True)
class _Piece:
    """One model call's worth of audio: an input, or one part of a long input."""

    item: int
    offset: float
    duration: float
    prompt: list[int]
    language: str | None
    max_new_tokens: int
    ignore_eos: bool


class ASR:
    def __init__(self, checkpoint: Checkpoint, max_chunk_sec: float = 1200.0,
                 engine: EngineConfig | None = None, max_pending: int = 256,
                 max_tokens_per_second: float = 15.0) -> None:
        """``max_pending`` bounds decoded-but-unfinished pieces (memory for huge input lists);
        ``max_tokens_per_second`` caps generation per piece from its duration unless the caller passes
        max_new_tokens, so a repetition loop stops early instead of running to the checkpoint limit."""
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

    def transcribe(self, audio: AudioInput | Sequence[AudioInput], language: str | None | Sequence = None,
                   context: str | Sequence[str] = "", sample_rate: int | None = None,
                   max_new_tokens: int | None = None, ignore_eos: bool = False,
                   progress: Callable[[int], None] | None = None) -> list[Transcription]:
        """Transcribe one input or a list; always returns one Transcription per input, in order.

        ``language`` forces the output language (a name or ISO code; None detects it); ``context`` is
        background text for the system turn. Scalars apply to every input, lists go item by item.
        ``sample_rate`` is needed for bare numpy arrays. ``max_new_tokens`` defaults per piece to
        ``ceil(max_tokens_per_second x seconds) + 24``, never above the checkpoint's generation_config
        limit; ``ignore_eos`` forces exactly that many tokens (for benchmarks). ``progress`` is called
        with 1 as each piece finishes.
        """
        items = _as_list(audio)
        languages = _broadcast(language, len(items), "language")
        contexts = _broadcast(context, len(items), "context")
        forced = [normalize_language(lang) for lang in languages]  # ValueError before any work
        results: list[Transcription | None] = [None] * len(items)
        durations = [0.0] * len(items)
        pending: deque[tuple[_Piece, Future]] = deque()
        done: dict[int, list[tuple[_Piece, list[int] | Exception]]] = {i: [] for i in range(len(items))}

        def settle(piece: _Piece, fut: Future) -> None:
            try:
                done[piece.item].append((piece, fut.result().token_ids))
            except Exception as exc:  # noqa: BLE001 - one piece's failure is that input's error
                done[piece.item].append((piece, exc))
            if progress is not None:
                progress(1)

        staged: list[tuple[_Piece, np.ndarray]] = []

        def submit_staged() -> None:
            # Longest first: long pieces start early instead of decoding alone at the end of a batch.
            for piece, samples in sorted(staged, key=lambda ps: -len(ps[1])):
                fut = self.engine.submit(piece.prompt, waveform=samples, max_new_tokens=piece.max_new_tokens,
                                         ignore_eos=piece.ignore_eos)
                pending.append((piece, fut))
            staged.clear()
            while len(pending) > self.max_pending:
                settle(*pending.popleft())

        for i, item in enumerate(items):
            try:
                wave = load_audio(item, sample_rate)
                durations[i] = len(wave) / SAMPLE_RATE
                pieces = self._pieces(i, wave, contexts[i] or "", forced[i], max_new_tokens, ignore_eos)
            except (AudioError, ValueError) as exc:
                name = _name(item)
                msg = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
                results[i] = Transcription("", "", durations[i], error=msg, source=name)
                continue
            staged += pieces
            if len(staged) >= self.max_pending:
                submit_staged()
        submit_staged()
        for piece, fut in pending:
            settle(piece, fut)
        for i, item in enumerate(items):
            if results[i] is None:
                mine = sorted(done[i], key=lambda pr: pr[0].offset)
                results[i] = self._assemble(mine, durations[i], _name(item))
        return results  # type: ignore[return-value]

    def _pieces(self, item: int, wave: np.ndarray, context: str, language: str | None,
                max_new_tokens: int | None, ignore_eos: bool) -> list[tuple[_Piece, np.ndarray]]:
        out = []
        hop = self.checkpoint.features.hop_length
        for piece in split_long_audio(wave, self.max_chunk_sec):
            frames = len(piece.samples) // hop
            if frames == 0:
                raise AudioError(f"audio too short ({len(piece.samples)} samples, need at least {hop})")
            n = audio_token_count(frames, self.checkpoint.config.encoder.chunk_frames)
            prompt = build_prompt(self.checkpoint.tokenizer, self.checkpoint.special, n, context, language)
            duration = min(len(piece.samples), len(wave) - round(piece.offset_sec * SAMPLE_RATE)) / SAMPLE_RATE
            cap = max_new_tokens or self.token_cap(duration)
            out.append((_Piece(item, piece.offset_sec, duration, prompt, language, cap, ignore_eos),
                        piece.samples))
        return out

    def token_cap(self, duration: float) -> int:
        """Default generation cap for a piece: the checkpoint's limit, or less for short audio."""
        limit = self.checkpoint.generation.max_new_tokens
        return max(1, min(limit, math.ceil(duration * self.max_tokens_per_second) + 24))

    def close(self) -> None:
        self.engine.close()

    def _assemble(self, mine: list[tuple[_Piece, list[int] | Exception]], duration: float,
                  source: str) -> Transcription:
        tok = self.checkpoint.tokenizer
        texts, langs, raws, ids, segments = [], [], [], [], []
        for piece, out in mine:
            if isinstance(out, Exception):
                return Transcription("", "", duration, error=f"{source}: {out}", source=source)
            raw = tok.decode(out, skip_special_tokens=True)
            lang, text = parse_asr_output(raw, piece.language)
            texts.append(text)
            langs.append(lang)
            raws.append(raw)
            ids += out
            segments.append(Segment(round(piece.offset, 3), round(piece.offset + piece.duration, 3), text))
        return Transcription(text="".join(texts), language=merge_languages(langs), duration=duration,
                             raw="".join(raws), token_ids=tuple(ids), segments=tuple(segments), source=source)


def _as_list(audio: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    if isinstance(audio, (str, os.PathLike, bytes, bytearray, np.ndarray, tuple)):
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
    if isinstance(item, (bytes, bytearray)):
        return "bytes input"
    return "array input"
