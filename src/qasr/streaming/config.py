"""Settings of a live transcription session (the official streaming state's knobs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamConfig:
    """``chunk_size_sec``: audio per step. The first ``unfixed_chunk_num`` steps decode without a text
    prefix; later steps feed back the previous raw output minus its last ``unfixed_token_num`` tokens
    as the start of the answer. ``max_new_tokens``: the cap of each step's generation (the official
    examples use 32). ``context``: system-turn text; ``language``: forced language or None to detect.
    Defaults are those of the official ``init_streaming_state``."""

    chunk_size_sec: float = 2.0
    unfixed_chunk_num: int = 2
    unfixed_token_num: int = 5
    max_new_tokens: int = 32
    context: str = ""
    language: str | None = None
    sample_rate: int = 16000

    def __post_init__(self) -> None:
        if self.chunk_size_samples < self.sample_rate // 100:  # every step must add a feature frame (10 ms)
            raise ValueError(f"chunk_size_sec must be at least 0.01, got {self.chunk_size_sec}")
        if self.unfixed_chunk_num < 0 or self.unfixed_token_num < 0:
            raise ValueError("unfixed_chunk_num and unfixed_token_num must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def chunk_size_samples(self) -> int:
        return int(round(self.chunk_size_sec * self.sample_rate))
