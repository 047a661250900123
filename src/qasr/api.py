"""The ASR facade: load a checkpoint once, transcribe files, bytes or arrays.

Every input is decoded, split when longer than ``max_chunk_sec``, turned into per-utterance
features and a prompt, and sent through greedy generation. A bad input yields a Transcription with
``error`` set; the other inputs in the same call still finish.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.audio.io import SAMPLE_RATE, AudioError, load_audio
from qasr.audio.split import split_long_audio
from qasr.engine.generate import GenRequest, generate
from qasr.features import LogMel
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
    features: torch.Tensor
    prompt: list[int]
    language: str | None
    max_new_tokens: int
    ignore_eos: bool


class ASR:
    def __init__(self, checkpoint: Checkpoint, max_chunk_sec: float = 1200.0, batch_size: int = 16) -> None:
        self.checkpoint = checkpoint
        self.max_chunk_sec = max_chunk_sec
        self.batch_size = batch_size
        self.features = LogMel(checkpoint.features)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "Qwen/Qwen3-ASR-0.6B", device: str = "auto",
                        dtype: str | torch.dtype = "auto", **kwargs: float) -> ASR:
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
        ``sample_rate`` is needed for bare numpy arrays. ``max_new_tokens`` defaults to the
        checkpoint's generation_config; ``ignore_eos`` forces that many tokens (for benchmarks).
        """
        items = _as_list(audio)
        languages = _broadcast(language, len(items), "language")
        contexts = _broadcast(context, len(items), "context")
        forced = [normalize_language(lang) for lang in languages]  # ValueError before any work
        cap = max_new_tokens or self.checkpoint.generation.max_new_tokens
        pieces: list[_Piece] = []
        results: list[Transcription | None] = [None] * len(items)
        durations = [0.0] * len(items)
        for i, item in enumerate(items):
            try:
                wave = load_audio(item, sample_rate)
                durations[i] = len(wave) / SAMPLE_RATE
                pieces += self._pieces(i, wave, contexts[i] or "", forced[i], cap, ignore_eos)
            except (AudioError, ValueError) as exc:
                name = _name(item)
                msg = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
                results[i] = Transcription("", "", durations[i], error=msg, source=name)
        outputs = self._run(pieces, progress)
        for i, item in enumerate(items):
            if results[i] is None:
                mine = [(p, outputs[k]) for k, p in enumerate(pieces) if p.item == i]
                results[i] = self._assemble(mine, durations[i], _name(item))
        return results  # type: ignore[return-value]

    def _pieces(self, item: int, wave: np.ndarray, context: str, language: str | None, cap: int,
                ignore_eos: bool) -> list[_Piece]:
        out = []
        for piece in split_long_audio(wave, self.max_chunk_sec):
            feats = self.features(piece.samples)
            if feats.shape[1] == 0:
                raise AudioError(f"audio too short ({len(piece.samples)} samples)")
            n = audio_token_count(feats.shape[1], self.checkpoint.config.encoder.chunk_frames)
            prompt = build_prompt(self.checkpoint.tokenizer, self.checkpoint.special, n, context, language)
            out.append(_Piece(item, piece.offset_sec, min(len(piece.samples), len(wave)) / SAMPLE_RATE,
                              feats, prompt, language, cap, ignore_eos))
        return out

    def _run(self, pieces: list[_Piece], progress: Callable[[int], None] | None) -> list[list[int]]:
        """Generate for all pieces, longest first in groups of batch_size (similar lengths batch well)."""
        order = sorted(range(len(pieces)), key=lambda k: -pieces[k].features.shape[1])
        outputs: list[list[int]] = [[] for _ in pieces]
        for start in range(0, len(order), self.batch_size):
            group = order[start:start + self.batch_size]
            reqs = [GenRequest(pieces[k].prompt, pieces[k].features, pieces[k].max_new_tokens,
                               pieces[k].ignore_eos) for k in group]
            for k, ids in zip(group, generate(self.checkpoint.model, reqs,
                                              self.checkpoint.generation.eos_token_ids), strict=True):
                outputs[k] = ids
            if progress is not None:
                progress(len(group))
        return outputs

    def _assemble(self, mine: list[tuple[_Piece, list[int]]], duration: float, source: str) -> Transcription:
        tok = self.checkpoint.tokenizer
        texts, langs, raws, ids, segments = [], [], [], [], []
        for piece, out in mine:
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
