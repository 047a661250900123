"""Result types returned by every front end."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

# Why a piece's text ended, one vocabulary from the engine to the outputs (docs/output-formats.md): "stop" the
# model's EOS, "length" max_new_tokens, "malformed" no <asr_text> tag (set when the text is read).
FinishReason = Literal["stop", "length", "malformed"]


@dataclass(frozen=True)
class Word:
    text: str
    start: float
    end: float
    # 0-1, as faster-whisper's; not compared
    probability: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()
    finish_reason: FinishReason = "stop"
    # Whisper's mean token log-probability; not compared (low bits depend on the batch)
    avg_logprob: float | None = field(default=None, compare=False)
    # UTF-8 bytes of ``text`` over their zlib size
    compression_ratio: float | None = None


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    duration: float  # seconds of input audio
    raw: str = ""
    token_ids: tuple[int, ...] = ()  # EOS excluded
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    error: str | None = None
    source: str = ""
    # the segments' worst; None when the input failed
    finish_reason: FinishReason | None = None
    # "word" when every segment with text has word times
    timestamps: str = "segment"

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


FINISH_SEVERITY = {"stop": 0, "length": 1, "malformed": 2}  # unknown reasons rank above


def worst_finish_reason(reasons: Iterable[FinishReason]) -> FinishReason:
    """The worst of the segments' reasons ("stop" for none)."""
    return max(reasons, key=lambda r: FINISH_SEVERITY.get(r, len(FINISH_SEVERITY)), default="stop")
