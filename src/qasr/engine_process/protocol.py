"""What crosses between the server and its engine process (docs/server.md, "The engine process").

The server sends ``Call``s, each with an id of its own; the engine process answers each with one ``Done`` (after
its ``Tokens`` when it streams), and sends ``Stats`` of every engine several times a second. Audio travels as
``SharedArray``s (engine_process/shared_array.py); a live turn's PCM and every answer are small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from qasr.engine.config import EngineConfig, EngineStats
from qasr.engine_process.shared_array import SharedArray
from qasr.streaming.config import StreamConfig

Role = Literal["asr", "aligner"]
Audio = SharedArray | np.ndarray  # float32: a waveform (16 kHz) or features (mel, frames)


@dataclass(frozen=True)
class Generate:
    """``Engine.submit`` of a piece; ``stream``: send its tokens as they come."""

    prompt: Sequence[int]
    max_new_tokens: int
    audio: Audio
    features: bool  # ``audio`` is log-mel features, not a waveform
    ignore_eos: bool = False
    interactive: bool = False
    group: int | None = None
    stream: bool = False


@dataclass(frozen=True)
class Align:
    """``Engine.submit_alignment`` on the aligner's engine."""

    prompt: Sequence[int]
    positions: Sequence[int]
    audio: Audio
    features: bool


@dataclass(frozen=True)
class TurnOpen:
    """Start a live turn (a streaming Session) with this id; Done's value is None."""

    config: StreamConfig


@dataclass(frozen=True)
class TurnPush:
    """``Session.push``: Done's value is the list of Updates."""

    turn: int
    pcm: np.ndarray


@dataclass(frozen=True)
class TurnFinish:
    """``Session.finish``: Done's value is the final Update; the turn is gone after it."""

    turn: int


@dataclass(frozen=True)
class TurnClose:
    """Drop a turn and its kept KV; Done's value is None."""

    turn: int


Work = Generate | Align | TurnOpen | TurnPush | TurnFinish | TurnClose


@dataclass(frozen=True)
class Call:
    id: int
    work: Work


@dataclass(frozen=True)
class Abort:
    """Cancel call ``id`` (its request stops at the next step)."""

    id: int


@dataclass(frozen=True)
class Close:
    """Close one engine (``drain``: finish what it holds); the process exits once every engine is closed."""

    role: Role
    drain: bool
    timeout_s: float | None


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of an engine it does not hold."""

    config: EngineConfig  # as the engine runs it (the GPU defaults applied)
    description: str
    cpu_features: bool  # the server makes log-mel features (else the device does, from waveforms)


@dataclass(frozen=True)
class Ready:
    engines: dict[str, EngineInfo]


@dataclass(frozen=True)
class LoadFailed:
    error: str


@dataclass(frozen=True)
class Tokens:
    """Tokens sampled since the last message, by call id, in order."""

    items: list[tuple[int, int]]


@dataclass(frozen=True)
class Done:
    id: int
    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Stats:
    engines: dict[str, EngineStats]


@dataclass(frozen=True)
class Closed:
    role: Role


ToEngine = Call | Abort | Close
FromEngine = Ready | LoadFailed | Tokens | Done | Stats | Closed
