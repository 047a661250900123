"""Result types returned by every front end."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Word:
    text: str
    start: float
    end: float
    # confidence, as faster-whisper users read it (docs/output-formats.md): exp of the lowest log-probability
    # among the generated tokens that overlap the word's characters (qasr.transcribe.word_confidence), so
    # 0-1; None where it cannot be had. Left out of ``==`` like Segment.avg_logprob (float32's last bits)
    probability: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Segment:
    """A stretch of the input: for now one per transcribed piece (long audio gives several)."""

    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()
    finish_reason: str = "stop"  # "stop": the model ended the text; "length": cut at max_new_tokens
    # confidence, as Whisper users read it (docs/output-formats.md): the mean log-probability (natural log)
    # of every token the model generated for this segment, the ``language X<asr_text>`` preamble's tokens
    # and the text's alike (EOS not counted); None when it generated nothing. Left out of ``==``: in float32 its
    # last bits may depend on what shared the request's batch (docs/engine.md, Identity) while the tokens do not
    avg_logprob: float | None = field(default=None, compare=False)
    # repetition: the UTF-8 bytes of ``text`` over their zlib-compressed size (Whisper's definition); None for
    # empty text
    compression_ratio: float | None = None


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    duration: float  # seconds of input audio
    raw: str = ""  # decoded model output before parsing
    token_ids: tuple[int, ...] = ()  # generated ids, EOS excluded (all pieces, in order)
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    error: str | None = None
    source: str = ""  # what was transcribed: a path, "bytes input" or "array input"
    # the worst of the segments' reasons ("length" beats "stop"): "length" means text may be missing;
    # None when the input failed
    finish_reason: str | None = None
    # "word" when every segment with text carries word times from the forced aligner, else "segment"
    timestamps: str = "segment"

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


FINISH_SEVERITY = {"stop": 0, "length": 1, "malformed": 2}  # unknown reasons rank above all of these


def worst_finish_reason(reasons: Iterable[str]) -> str:
    """An input's finish reason: the worst of its segments' ("stop" when it has none)."""
    return max(reasons, key=lambda r: FINISH_SEVERITY.get(r, len(FINISH_SEVERITY)), default="stop")
