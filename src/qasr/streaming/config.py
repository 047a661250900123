"""Live-session settings, declared, documented and checked here once (``ASR.stream``, ``ASR.live``, the
server's /v1/stream start message), with the ranges a server's client may choose."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from qasr.audio.vad import VadBackend


def _setting(default: object, help: str, start: type | None = None,
             served: tuple[float, float] | None = None) -> Any:
    """A field with its help text; ``start``: the JSON type a /v1/stream start message may set it with;
    ``served``: the range (inclusive) a server takes from a client or its operator."""
    return field(default=default, metadata={"help": help, "start": start, "served": served})


@dataclass(frozen=True)
class StreamConfig:
    """One turn of the official streaming algorithm; the defaults are those of its ``init_streaming_state``."""

    chunk_size_sec: float = _setting(2.0, "audio per step, in seconds", float, served=(0.25, 30.0))
    unfixed_chunk_num: int = _setting(2, "the first steps decode without a text prefix")
    unfixed_token_num: int = _setting(5, "later steps feed back the previous output minus this many last tokens")
    max_new_tokens: int = _setting(32, "cap of each step's generation")
    context: str = _setting("", "system-turn text", str)
    language: str | None = _setting(None, "forced language; None: detect", str)
    sample_rate: int = _setting(16000, "of the samples pushed")
    engine_timeout_s: float | None = _setting(None, "a step whose engine request has no answer this long fails "
                                                    "with EngineTimeout; None: it waits")

    def __post_init__(self) -> None:
        if self.chunk_size_samples < self.sample_rate // 100:  # every step must add a feature frame (a hop)
            raise ValueError(f"chunk_size_sec must be at least 0.01, got {self.chunk_size_sec}")
        if self.unfixed_chunk_num < 0 or self.unfixed_token_num < 0:
            raise ValueError("unfixed_chunk_num and unfixed_token_num must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.engine_timeout_s is not None and not self.engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be > 0 or None, got {self.engine_timeout_s}")

    @property
    def chunk_size_samples(self) -> int:
        return int(round(self.chunk_size_sec * self.sample_rate))


@dataclass(frozen=True)
class LiveConfig:
    """A stream of any length cut into turns of ``stream``; the VAD defaults are OpenAI's server VAD's."""

    stream: StreamConfig = field(default_factory=StreamConfig)
    turn_detection: bool = _setting(True, "cut turns by VAD; else only commit() and max_turn_s end one", bool)
    vad_threshold: float = _setting(0.5, "speech probability that starts a turn", float)
    vad_backend: VadBackend = _setting("auto", "the scorer: auto = silero when installed, else energy")
    silence_ms: int = _setting(500, "the pause that ends a turn", int, served=(0, 10000))
    prefix_padding_ms: int = _setting(300, "audio before the detected start that the turn also gets", int,
                                      served=(0, 10000))
    max_turn_s: float = _setting(60.0, "a turn never gets longer", float, served=(1.0, 120.0))
    soft_turn_s: float = _setting(30.0, "past this, any silent frame ends the turn", float)
    carry_context: bool = _setting(False, "give the next turn the end of the text committed so far as context",
                                   bool)
    carried_chars: int = _setting(500, "how much of it: the last this many characters")
    end_on_chunk: bool = _setting(True, "a turn a pause ends, ends at its next chunk boundary", bool)

    def __post_init__(self) -> None:
        if not 0.0 < self.vad_threshold < 1.0:
            raise ValueError(f"vad_threshold must be in (0, 1), got {self.vad_threshold}")
        if self.silence_ms < 0 or self.prefix_padding_ms < 0:
            raise ValueError("silence_ms and prefix_padding_ms must be >= 0")
        if not 0 < self.soft_turn_s <= self.max_turn_s:
            raise ValueError(f"need 0 < soft_turn_s <= max_turn_s, got {self.soft_turn_s} and {self.max_turn_s}")
        if self.max_turn_s < self.stream.chunk_size_sec:
            raise ValueError("max_turn_s must be at least one chunk (stream.chunk_size_sec)")
        if self.carried_chars < 0:
            raise ValueError("carried_chars must be >= 0")


START_SETTINGS = {f.name: f.metadata["start"] for cls in (StreamConfig, LiveConfig) for f in fields(cls)
                  if f.metadata.get("start")}
SERVED_RANGES: dict[str, tuple[float, float]] = {
    f.name: f.metadata["served"] for cls in (StreamConfig, LiveConfig) for f in fields(cls) if f.metadata.get("served")}


def check_served(name: str, value: float, label: str | None = None) -> None:
    """ValueError naming the range when ``value`` is outside the range a server takes for setting ``name``
    (``label``: what the message calls it, if not ``name``)."""
    low, high = SERVED_RANGES[name]
    if not low <= value <= high:
        raise ValueError(f"{label or name} must be from {low:g} to {high:g}, got {value:g}")


def from_start(settings: Mapping[str, object], base: LiveConfig = LiveConfig()) -> LiveConfig:
    """``base`` with a /v1/stream start message's START_SETTINGS (flat, JSON-typed; a null text: its default;
    a number within its SERVED_RANGES). A ``max_turn_s`` below ``base.soft_turn_s`` lowers that too. Raises
    ValueError for a bad setting."""
    unknown = sorted(set(settings) - set(START_SETTINGS))
    if unknown:
        raise ValueError(f"unknown settings {unknown}")
    typed: dict[str, object] = {}
    for key, value in settings.items():
        kind = START_SETTINGS[key]
        if kind is str and value is None:
            value = getattr(StreamConfig, key)
        elif kind is bool and not isinstance(value, bool) or kind is str and not isinstance(value, str) or (
                kind in (int, float) and not isinstance(value, int | float)):
            raise ValueError(f"{key} must be a {kind.__name__}, got {value!r}")
        if key in SERVED_RANGES:
            check_served(key, value)
        typed[key] = kind(value) if kind in (int, float) else value
    if "max_turn_s" in typed and "soft_turn_s" not in typed:
        typed["soft_turn_s"] = min(base.soft_turn_s, typed["max_turn_s"])
    names = {f.name for f in fields(StreamConfig)}
    stream = replace(base.stream, **{k: v for k, v in typed.items() if k in names})
    return replace(base, stream=stream, **{k: v for k, v in typed.items() if k not in names})
