"""One generation request and its progress through the engine."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

_ids = itertools.count()


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated ids, EOS excluded
    finish_reason: str  # "eos" | "length"
    ttft_s: float  # submit -> first generated token
    latency_s: float  # submit -> done


@dataclass(eq=False)
class Request:
    """A prompt plus its audio. Features are computed at admission, not at submit, so a long queue
    holds only waveforms (or nothing extra when callers share arrays), never everyone's features."""

    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    audio_tokens: int = 0  # audio placeholders in the prompt (= encoder output rows)
    future: Future = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    # progress (owned by the engine thread)
    start: int = -1  # KV region start
    reserved: int = 0  # KV region length
    audio: torch.Tensor | None = None  # encoder output (T, hidden)
    audio_before: np.ndarray | None = None  # audio placeholders in prompt[:i], for chunked prefill
    prefilled: int = 0  # prompt tokens already in the cache
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None

    @property
    def needs_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def encoded(self) -> bool:
        """Set by the encoder step; stays true after the encoder output is released."""
        return self.audio_before is not None

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt)
