"""A live session: speech detection cuts the stream into turns, each a ``Session`` on its own audio (bounded
memory). The rules are in docs/streaming.md, "Live sessions"."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np

from qasr.audio.io import SAMPLE_RATE
from qasr.audio.vad import make_scorer, resolve_backend
from qasr.audio.vad_models import FRAME, FrameScorer
from qasr.engine.engine import Engine
from qasr.model.checkpoint import Checkpoint
from qasr.streaming.config import LiveConfig, StreamConfig
from qasr.streaming.pcm import SampleBuffer, as_float_pcm
from qasr.streaming.session import Session, Update

EndReason = Literal["pause", "long", "max", "commit", "finish"]
VAD_HYSTERESIS = 0.15  # exit threshold below the start threshold


@dataclass(frozen=True)
class SpeechStarted:
    turn: int
    at: float  # seconds, pre-roll included


@dataclass(frozen=True)
class SpeechStopped:
    turn: int
    at: float  # seconds, where the ending silence began


@dataclass(frozen=True)
class TurnUpdate:
    """``delta``: the text that became stable with this step."""

    turn: int
    update: Update
    delta: str


@dataclass(frozen=True)
class TurnFinal:
    """The end of a turn: ``text`` is its deltas joined, this one's included."""

    turn: int
    text: str
    language: str
    delta: str
    start: float
    end: float
    reason: EndReason


LiveEvent = SpeechStarted | SpeechStopped | TurnUpdate | TurnFinal


class Turn(Protocol):
    """What a live session drives each turn through: a ``Session``, or one run in the engine process."""

    @property
    def samples(self) -> int: ...

    def push(self, pcm: np.ndarray) -> list[Update]: ...

    def finish(self) -> Update: ...

    def close(self) -> None: ...


OpenTurn = Callable[[StreamConfig], Turn]


class LiveSession:
    """Driven from one thread at a time."""

    def __init__(self, engine: Engine, checkpoint: Checkpoint, config: LiveConfig | None = None,
                 open_turn: OpenTurn | None = None) -> None:
        """``open_turn``: how a turn starts (default: a ``Session`` on ``engine``)."""
        self.engine = engine
        self.checkpoint = checkpoint
        self._open_turn = open_turn
        self.config = cfg = config or LiveConfig()
        chunk = cfg.stream.chunk_size_samples
        self._buffer = SampleBuffer(int(cfg.max_turn_s * SAMPLE_RATE) + chunk + 2 * FRAME)
        self.vad_backend = resolve_backend(cfg.vad_backend) if cfg.turn_detection else None
        self._scorer: FrameScorer | None = make_scorer(self.vad_backend) if self.vad_backend else None
        self._exit = max(cfg.vad_threshold - VAD_HYSTERESIS, 0.01)
        self._silence_limit = cfg.silence_ms * SAMPLE_RATE // 1000
        self._preroll: deque[np.ndarray] = deque(maxlen=math.ceil(cfg.prefix_padding_ms * SAMPLE_RATE / 1000 / FRAME))
        self._pending = np.zeros(0, dtype=np.float32)
        self.position = 0
        self.turns = 0
        self._turn: Turn | None = None
        self._turn_start = 0
        self._stable = ""
        self._in_speech = False
        self._silence = 0
        # a turn silence ended, padded to its chunk boundary
        self._closing: EndReason | None = None
        self._carried = ""
        self.closed = False

    @property
    def in_turn(self) -> bool:
        return self._turn is not None

    @property
    def turn_seconds(self) -> float:
        return self._turn.samples / SAMPLE_RATE if self._turn is not None else 0.0

    def push(self, pcm: np.ndarray) -> list[LiveEvent]:
        """Add 16 kHz samples (float32 or int16, any count); returns the events they caused, in order."""
        self._check_open()
        x = as_float_pcm(pcm)
        self._pending = np.concatenate((self._pending, x)) if self._pending.size else x
        n = self._pending.size // FRAME
        out: list[LiveEvent] = []
        if n == 0:
            return out
        frames = self._pending[: n * FRAME].reshape(n, FRAME)
        self._pending = self._pending[n * FRAME:]
        for frame in frames:
            if self._scorer is None:
                self._frame_undetected(frame, out)
            else:  # a frame a call: turns do not depend on how pushes were sized
                self._frame_detected(frame, float(self._scorer.score(frame[None])[0]), out)
        return out

    def commit(self) -> list[LiveEvent]:
        """End the current turn now, the samples short of a frame included."""
        self._check_open()
        out: list[LiveEvent] = []
        if self._closing is not None:
            self._close_padded(out)
        self._flush_pending(out)
        if self._turn is not None:
            if self._in_speech:
                out.append(SpeechStopped(self.turns - 1, self.position / SAMPLE_RATE))
            self._end_turn("commit", out)
        return out

    def clear(self) -> None:
        """Drop the current turn's audio (no final transcript) and what is pending."""
        self._check_open()
        self._drop_turn()
        self.position += self._pending.size
        self._pending = np.zeros(0, dtype=np.float32)
        self._preroll.clear()
        self._in_speech, self._silence, self._closing = False, 0, None

    def finish(self) -> list[LiveEvent]:
        """End of stream: the open turn gets what is pending, and its final."""
        out: list[LiveEvent] = []
        if self.closed:
            return out
        if self._closing is not None:
            self._close_padded(out)
        self._flush_pending(out)
        if self._turn is not None:
            if self._in_speech:
                out.append(SpeechStopped(self.turns - 1, self.position / SAMPLE_RATE))
            self._end_turn("finish", out)
        self.closed = True
        return out

    def close(self) -> None:
        """Abandon the session, freeing the open turn's engine state."""
        self._drop_turn()
        self.closed = True

    def _frame_undetected(self, frame: np.ndarray, out: list[LiveEvent]) -> None:
        if self._turn is None:
            self._start_turn(self.position, out, announce=False)
        self._feed(frame, out)
        if self._turn_full():
            self._end_turn("max", out)

    def _frame_detected(self, frame: np.ndarray, p: float, out: list[LiveEvent]) -> None:
        cfg = self.config
        if self._closing is not None:
            if p < self._exit and self._pad(frame, out):
                return
            self._close_padded(out)
        if not self._in_speech:
            if p < cfg.vad_threshold:
                self._preroll.append(frame)
                self.position += frame.size
                return
            preroll = list(self._preroll)
            self._preroll.clear()
            self._in_speech, self._silence = True, 0
            self._start_turn(self.position - sum(f.size for f in preroll), out, announce=True)
            for f in preroll:
                self._feed(f, out, advance=False)
            self._feed(frame, out)
            return
        self._feed(frame, out)
        if p < self._exit:
            self._silence += frame.size
        elif p >= cfg.vad_threshold:
            self._silence = 0
        silent = p < self._exit
        paused = self._silence >= self._silence_limit
        if silent and (paused or self.turn_seconds >= cfg.soft_turn_s):
            reason: EndReason = "pause" if paused else "long"
            self._in_speech = False
            out.append(SpeechStopped(self.turns - 1, (self.position - self._silence) / SAMPLE_RATE))
            if cfg.end_on_chunk and self._chunk_room() > 0:
                self._closing = reason
                return
            self._end_turn(reason, out)
        elif self._turn_full():
            out.append(SpeechStopped(self.turns - 1, self.position / SAMPLE_RATE))
            self._end_turn("max", out)
            self._silence = 0
            self._start_turn(self.position, out, announce=True)

    def _chunk_room(self) -> int:
        assert self._turn is not None
        chunk = self.config.stream.chunk_size_samples
        return -self._turn.samples % chunk

    def _pad(self, frame: np.ndarray, out: list[LiveEvent]) -> bool:
        """Give a silent frame to a closing turn up to its chunk boundary; False past ``max_turn_s``."""
        room = self._chunk_room()
        if (self._turn.samples + min(room, frame.size)) / SAMPLE_RATE > self.config.max_turn_s:
            return False
        self._preroll.append(frame)
        self._feed(frame[:room], out, advance=False)
        self.position += frame.size
        if room <= frame.size:
            self._close_padded(out)
        return True

    def _close_padded(self, out: list[LiveEvent]) -> None:
        assert self._closing is not None
        reason, self._closing = self._closing, None
        self._end_turn(reason, out)

    def _flush_pending(self, out: list[LiveEvent]) -> None:
        if self._pending.size == 0:
            return
        rest, self._pending = self._pending, np.zeros(0, dtype=np.float32)
        if self._turn is None and self._scorer is None:
            self._start_turn(self.position, out, announce=False)
        if self._turn is not None:
            self._feed(rest, out)
        else:
            self.position += rest.size

    def _turn_full(self) -> bool:
        return self.turn_seconds >= self.config.max_turn_s

    @property
    def next_context(self) -> str:
        """The configured context, plus (``carry_context``) the end of the text so far."""
        base = self.config.stream.context
        if not (self.config.carry_context and self._carried):
            return base
        return f"{base}\n{self._carried}" if base else self._carried

    def _start_turn(self, start: int, out: list[LiveEvent], announce: bool) -> None:
        stream = replace(self.config.stream, context=self.next_context)
        if self._open_turn is not None:
            self._turn = self._open_turn(stream)
        else:
            self._turn = Session(self.engine, self.checkpoint, stream, buffer=self._buffer)
        self._turn_start = start
        self._stable = ""
        if announce:
            out.append(SpeechStarted(self.turns, start / SAMPLE_RATE))
        self.turns += 1

    def _feed(self, samples: np.ndarray, out: list[LiveEvent], advance: bool = True) -> None:
        assert self._turn is not None
        if advance:
            self.position += samples.size
        for update in self._turn.push(samples):
            delta = update.stable_text[len(self._stable):]
            self._stable = update.stable_text
            out.append(TurnUpdate(self.turns - 1, update, delta))

    def _end_turn(self, reason: EndReason, out: list[LiveEvent]) -> None:
        turn, self._turn = self._turn, None
        assert turn is not None
        try:
            final = turn.finish()
        finally:
            turn.close()
        text = final.stable_text
        start = self._turn_start / SAMPLE_RATE
        out.append(TurnFinal(self.turns - 1, text, final.language, text[len(self._stable):], start,
                             start + turn.samples / SAMPLE_RATE, reason))
        self._stable = ""
        if self.config.carry_context and text:
            self._carried = (f"{self._carried} {text}" if self._carried else text)[-self.config.carried_chars:]

    def _drop_turn(self) -> None:
        self._closing = None
        if self._turn is not None:
            self._turn.close()
            self._turn = None
            self._stable = ""

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the live session is closed")
