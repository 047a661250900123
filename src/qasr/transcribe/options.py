"""The transcription options: declared, documented and checked once, for every entry point."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from qasr.audio.cutting import Cut
    from qasr.audio.vad import VadConfig

SEGMENTATIONS = ("auto", "vad", "fixed", "none")
TIMESTAMPS = ("segment", "word")


def _option(default: object, help: str, flag: dict | None = None) -> Any:
    """A field, its help, and its ``qasr transcribe`` flag, if any (``number``: a positive int or float)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class TranscribeOptions:
    """How a call transcribes; a bad value raises ValueError naming it. ``language`` and ``context`` may be
    lists (one per input). ``metadata["help"]`` says what a field means."""

    language: str | Sequence[str | None] | None = _option(
        None, "force the language (name or ISO code the model lists); default: detect", {})
    context: str | Sequence[str] = _option(
        "", "background text / hotwords for the system turn", {})
    sample_rate: int | None = _option(None, "the rate of bare numpy array inputs")
    max_new_tokens: int | None = _option(
        None, "cap on generated tokens per piece (default: ceil(15 x seconds) + 24 for each piece; a piece cut at "
              "the cap is reported with a warning)", {"number": int})
    ignore_eos: bool = _option(False, "generate exactly max_new_tokens tokens (benchmarks)")
    segmentation: str = _option(
        "auto", "how long inputs are cut: vad = speech regions merged into segments cut at the longest pauses "
                "(silence skipped); fixed = consecutive windows; none = whole (cut only past 20 minutes); auto "
                "(default) = none up to --max-segment-s, vad beyond", {"choices": SEGMENTATIONS})
    max_segment_s: float | None = _option(
        None, "longest segment in seconds (default: what the model's config.json declares, "
              "\"qasr\": {\"max_segment_s\": S}, else 30)", {"number": float, "metavar": "S"})
    vad: VadConfig | None = _option(None, "the speech detector's settings (qasr.VadConfig); default: its own")
    timestamps: str = _option(
        "segment", "segment (default) or word: word times from --aligner fill json's words and make srt/vtt/tsv "
                   "cues break at word boundaries (without an aligner: a warning, segment times)",
        {"choices": TIMESTAMPS})

    def __post_init__(self) -> None:
        from qasr.model.prompt import normalize_language

        for name in ("language", "context"):  # a list goes item by item: kept as a tuple
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, tuple(value))
        for lang in self.language if isinstance(self.language, tuple) else (self.language,):
            normalize_language(lang)  # the model's own list is checked per call
        if self.sample_rate is not None and self.sample_rate < 1:
            raise ValueError(f"sample_rate must be >= 1, got {self.sample_rate}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {', '.join(SEGMENTATIONS)}, got {self.segmentation!r}")
        if self.max_segment_s is not None and not self.max_segment_s > 0:
            raise ValueError(f"max_segment_s must be positive, got {self.max_segment_s}")
        if self.timestamps not in TIMESTAMPS:
            raise ValueError(f"timestamps must be one of {', '.join(TIMESTAMPS)}, got {self.timestamps!r}")

    @property
    def words(self) -> bool:
        return self.timestamps == "word"

    def given(self, **shortcuts: object) -> TranscribeOptions:
        """These options, each shortcut that is not None replacing its field."""
        changed = {name: value for name, value in shortcuts.items() if value is not None}
        return replace(self, **changed) if changed else self

    def for_model(self, model: ModelDefaults | None) -> TranscribeOptions:
        """With what they leave to the model filled in (the package's defaults for a model not known)."""
        if self.max_segment_s is not None:
            return self
        from qasr.model.config import DEFAULT_MAX_SEGMENT_S

        return replace(self, max_segment_s=float(model.max_segment_s if model else DEFAULT_MAX_SEGMENT_S))


class ModelDefaults(Protocol):
    max_segment_s: float


def model_language(lang: str | None, supported: Sequence[str]) -> str | None:
    """``lang`` (a name or ISO code, any case) as the name ``supported`` lists; None or blank: detect. The
    ValueError lists ``supported`` and the closest of them, for names and codes alike."""
    from qasr.model.prompt import LANGUAGE_CODES, normalize_language

    try:
        name = normalize_language(lang)
    except ValueError:
        name = ""
    if name is None or name in supported:
        return name
    spellings = {n.lower(): n for n in supported} | {c: n for c, n in LANGUAGE_CODES.items() if n in supported}
    close = difflib.get_close_matches(str(lang).strip().lower(), spellings, n=1)
    hint = f" (did you mean {spellings[close[0]]}?)" if close else ""
    raise ValueError(f"language {lang!r} is not supported by this model{hint}; supported: {', '.join(supported)}")


def cut(item: object, options: TranscribeOptions) -> Cut:
    from qasr.audio.cutting import cut_input

    return cut_input(item, segmentation=options.segmentation, max_s=options.max_segment_s,
                     vad=options.vad, sample_rate=options.sample_rate)


def add_flags(parser: argparse.ArgumentParser, positive: dict[type, Any]) -> None:
    """The options' ``qasr transcribe`` flags; ``positive``: the argparse type of each kind of number."""
    for f in fields(TranscribeOptions):
        if f.metadata["flag"] is None:
            continue
        flag = dict(f.metadata["flag"])
        if "number" in flag:
            flag["type"] = positive[flag.pop("number")]
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **flag)


def from_flags(args: argparse.Namespace) -> TranscribeOptions:
    """The options ``qasr transcribe`` was given (its --vad-* flags make the ``vad`` option)."""
    vad = None
    if args.vad_backend != "auto" or args.vad_threshold is not None:
        from qasr.audio.vad import VadConfig

        tuned = {} if args.vad_threshold is None else {"threshold": args.vad_threshold}
        vad = VadConfig(backend=args.vad_backend, **tuned)
    given = {f.name: getattr(args, f.name) for f in fields(TranscribeOptions) if f.metadata["flag"] is not None}
    return TranscribeOptions(vad=vad, **given)
