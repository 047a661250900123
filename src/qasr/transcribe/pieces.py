"""Pieces: what one engine request is made of (audio, prompt, token cap), built from a decoded input.

This is the seam between the facade and the engine: ``ASR.prepare`` hands pieces to callers who drive
the engine themselves, and ``ASR.transcribe`` submits the very same pieces, so both paths produce
identical requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qasr.audio.io import SAMPLE_RATE, AudioError
from qasr.audio.split import split_long_audio
from qasr.model.checkpoint import Checkpoint
from qasr.model.config import audio_token_count
from qasr.model.prompt import ASR_TEXT_TAG, build_prompt, parse_asr_output

# Tokens every piece may spend beyond its per-second budget: the `language X<asr_text>` preamble,
# EOS, and room for a short clip's words.
CAP_HEADROOM = 24


@dataclass(frozen=True, eq=False)  # eq=False: comparing the sample arrays element-wise makes no sense
class Piece:
    """One engine request's worth of audio: a whole input, or one part of a long one.

    Submit it as ``engine.submit(p.prompt, waveform=p.samples, max_new_tokens=p.max_new_tokens)``.
    """

    source: str  # the input's name: its path, "bytes input" or "array input"
    item: int  # index of the input in the call that prepared it
    offset: float  # seconds from the start of the input
    duration: float  # seconds of real audio (tail padding of a very short piece not counted)
    samples: np.ndarray  # (n,) float32 mono at 16 kHz: what the engine encodes
    prompt: tuple[int, ...]  # the chat prompt, audio placeholders expanded
    language: str | None  # forced language (canonical name); None: the model detects it
    max_new_tokens: int  # generation cap for this piece


def default_token_cap(duration: float, tokens_per_second: float) -> int:
    """``ceil(tokens_per_second x seconds) + 24``: room for fast speech, yet a repetition loop ends early.

    Deliberately not clipped by the checkpoint's generation_config: its max_new_tokens is a limit for one
    short clip, and clipping by it silently truncated long recordings.
    """
    # round() first: 2.4 s x 15 is 36.000000000000004 in floating point, which must not become 37
    return math.ceil(round(duration * tokens_per_second, 6)) + CAP_HEADROOM


def make_piece(checkpoint: Checkpoint, samples: np.ndarray, *, source: str, item: int, offset: float,
               duration: float, context: str, language: str | None, max_new_tokens: int | None,
               tokens_per_second: float) -> Piece:
    """One piece from its 16 kHz samples: the prompt with its audio placeholders, and its token cap.

    Raises AudioError when the samples are too short to give the encoder a single frame.
    """
    hop = checkpoint.features.hop_length
    frames = len(samples) // hop
    if frames == 0:
        raise AudioError(f"{source}: audio too short ({len(samples)} samples, need at least {hop})")
    prompt = build_prompt(checkpoint.tokenizer, checkpoint.special,
                          audio_token_count(frames, checkpoint.config.encoder.conv_chunk_frames), context, language)
    cap = max_new_tokens if max_new_tokens is not None else default_token_cap(duration, tokens_per_second)
    return Piece(source, item, offset, duration, samples, tuple(prompt), language, cap)


def make_pieces(checkpoint: Checkpoint, wave: np.ndarray, *, source: str, item: int, context: str,
                language: str | None, max_new_tokens: int | None, max_chunk_sec: float,
                tokens_per_second: float) -> list[Piece]:
    """Split a decoded 16 kHz waveform at ``max_chunk_sec`` (the official long-audio rule: cuts at the
    quietest spot near each limit) and build each piece's prompt and cap.

    Raises AudioError when a piece is too short to give the encoder a single frame.
    """
    pieces = []
    for part in split_long_audio(wave, max_chunk_sec):
        # padding never counts as audio: the piece ends where the input does
        real = min(len(part.samples), len(wave) - round(part.offset_sec * SAMPLE_RATE))
        pieces.append(make_piece(checkpoint, part.samples, source=source, item=item, offset=part.offset_sec,
                                 duration=real / SAMPLE_RATE, context=context, language=language,
                                 max_new_tokens=max_new_tokens, tokens_per_second=tokens_per_second))
    return pieces


def read_output(raw: str, piece: Piece) -> tuple[str, str, bool]:
    """``(language, text, malformed)`` of a piece's decoded output.

    Malformed: the language was left to the model and its output lacks the ``<asr_text>`` tag, so
    whatever came out (e.g. "langu") is a prompt fragment, not a transcript; its text is then empty."""
    language, text = parse_asr_output(raw, piece.language)
    if piece.language is None and raw.strip() and ASR_TEXT_TAG not in raw:
        return language, "", True
    return language, text, False
