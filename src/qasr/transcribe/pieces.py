"""Pieces: what one engine request is made of (audio, prompt, token cap)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from qasr.audio.features import LogMel
from qasr.audio.io import SAMPLE_RATE, AudioError
from qasr.audio.split import split_long_audio
from qasr.model.checkpoint import Checkpoint
from qasr.model.config import audio_token_count
from qasr.model.prompt import ASR_TEXT_TAG, build_prompt, parse_asr_output

CAP_HEADROOM = 24  # the `language X<asr_text>` preamble, EOS, a short clip's words
NO_SAMPLES = np.zeros(0, dtype=np.float32)  # a piece's samples once nothing needs them


@dataclass(frozen=True, eq=False)  # no element-wise comparison of samples
class Piece:
    """One engine request: ``RequestSpec(p.prompt, p.max_new_tokens, features=p.features)``, or
    ``waveform=p.samples`` where the piece was made without its log-mel (the engine then makes it)."""

    source: str
    item: int  # the input's index in its call
    offset: float  # seconds into the input
    duration: float  # seconds of real audio (padding not counted)
    samples: np.ndarray  # (n,) float32 mono at 16 kHz; NO_SAMPLES once only the features are needed
    prompt: tuple[int, ...]
    language: str | None  # forced (canonical name); None: detected
    max_new_tokens: int
    features: torch.Tensor | None = None  # (mel, n // hop) float32 log-mel of the samples, made with the piece


def default_token_cap(duration: float, tokens_per_second: float) -> int:
    """``ceil(tokens_per_second x seconds) + 24``, not clipped by generation_config."""
    # round() first: 2.4 s x 15 is 36.000000000000004, which must not become 37
    return math.ceil(round(duration * tokens_per_second, 6)) + CAP_HEADROOM


def make_piece(checkpoint: Checkpoint, samples: np.ndarray, *, source: str, item: int, offset: float,
               duration: float, context: str, language: str | None, max_new_tokens: int | None,
               tokens_per_second: float, log_mel: LogMel | None = None) -> Piece:
    """One piece from its 16 kHz samples (``log_mel``: with their features, made on this thread); AudioError
    when they are too short for one encoder frame."""
    hop = checkpoint.features.hop_length
    frames = len(samples) // hop
    if frames == 0:
        raise AudioError(f"{source}: audio too short ({len(samples)} samples, need at least {hop})")
    prompt = build_prompt(checkpoint.tokenizer, checkpoint.special,
                          audio_token_count(frames, checkpoint.config.encoder.conv_chunk_frames), context, language)
    cap = max_new_tokens if max_new_tokens is not None else default_token_cap(duration, tokens_per_second)
    features = None if log_mel is None else log_mel(samples)
    return Piece(source, item, offset, duration, samples, tuple(prompt), language, cap, features)


def make_pieces(checkpoint: Checkpoint, wave: np.ndarray, *, source: str, item: int, context: str,
                language: str | None, max_new_tokens: int | None, max_chunk_sec: float,
                tokens_per_second: float, log_mel: LogMel | None = None) -> list[Piece]:
    """A decoded 16 kHz waveform's pieces, cut at the quietest spot near each ``max_chunk_sec``."""
    pieces = []
    for part in split_long_audio(wave, max_chunk_sec):
        real = min(len(part.samples), len(wave) - round(part.offset_sec * SAMPLE_RATE))
        pieces.append(make_piece(checkpoint, part.samples, source=source, item=item, offset=part.offset_sec,
                                 duration=real / SAMPLE_RATE, context=context, language=language,
                                 max_new_tokens=max_new_tokens, tokens_per_second=tokens_per_second,
                                 log_mel=log_mel))
    return pieces


def read_output(raw: str, piece: Piece) -> tuple[str, str, bool]:
    """``(language, text, malformed)`` of a piece's output; malformed (no ``<asr_text>`` tag): no text."""
    language, text = parse_asr_output(raw, piece.language)
    if piece.language is None and raw.strip() and ASR_TEXT_TAG not in raw:
        return language, "", True
    return language, text, False
