"""Inputs to results: a decode thread cuts inputs into pieces and submits them, a bounded amount at a time."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

from qasr.audio.io import AudioError
from qasr.transcribe.pieces import NO_SAMPLES, Piece

_POLL_S = 0.25  # the consumer wakes this often, so Ctrl-C is seen
_JOIN_S = 30.0  # how long an early exit waits for the decode thread


class PieceSource(Protocol):
    duration: float

    def __iter__(self) -> Iterator[Piece]: ...


@dataclass
class _Input:
    pieces: list[Piece] = field(default_factory=list)  # without their samples and features
    futures: list[Future] = field(default_factory=list)
    settled: int = 0
    shown: int = 0  # pieces handed to ``piece_done``
    total: int | None = None  # known once the input is cut
    duration: float = 0.0
    error: str | None = None


class _AudioBudget:
    def __init__(self, limit_s: float, limit_pieces: int | None = None) -> None:
        self.limit_s = limit_s
        self.limit_pieces = limit_pieces
        self.used_s = 0.0
        self.pieces = 0
        self.cond = threading.Condition()

    def _full(self, seconds: float) -> bool:
        if self.pieces == 0:
            return False  # one piece always fits
        return (self.used_s + seconds > self.limit_s
                or (self.limit_pieces is not None and self.pieces >= self.limit_pieces))

    def acquire(self, seconds: float, stop: threading.Event, before_waiting: Callable[[], None] | None = None) -> bool:
        with self.cond:
            if before_waiting is not None and self._full(seconds) and not stop.is_set():
                before_waiting()
            while self._full(seconds) and not stop.is_set():
                self.cond.wait()
            if stop.is_set():
                return False
            self.used_s += seconds
            self.pieces += 1
            return True

    def release(self, seconds: float) -> None:
        with self.cond:
            self.used_s -= seconds
            self.pieces -= 1
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


def run_inputs(count: int, *, pieces_of: Callable[[int], PieceSource], submit: Callable[[Piece], Future],
               finish: Callable[[int, list[Piece], list[Future], float], object],
               fail: Callable[[int, str], object], max_in_flight_s: float,
               max_in_flight_pieces: int | None = None,
               progress: Callable[[float], None] | None = None,
               stop: threading.Event | None = None,
               piece_done: Callable[[int, Piece, Future], object] | None = None,
               idle: Callable[[], None] | None = None) -> Iterator[tuple[int, object]]:
    """Yield ``(i, finish(...) or fail(...))`` as each input completes (``piece_done``: each piece's value too,
    in order). ``idle`` runs before the decode thread waits; closing, or ``stop``, cancels the rest."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    budget = _AudioBudget(max_in_flight_s, max_in_flight_pieces)
    halt = threading.Event()  # the decode thread's own stop
    handover = threading.Lock()

    def settled(i: int, seconds: float) -> Callable[[Future], None]:
        def callback(_: Future) -> None:  # runs on the engine thread: keep it short
            budget.release(seconds)
            events.put(("settled", i, seconds))
        return callback

    def produce() -> None:
        try:
            for i in range(count):
                if halt.is_set():
                    return
                n = 0
                try:
                    source = pieces_of(i)
                    for piece in source:
                        if not budget.acquire(piece.duration, halt, idle):
                            return
                        fut = submit(piece)
                        with handover:  # the consumer sees this request, or it is cancelled here
                            if halt.is_set():
                                fut.cancel()
                                return
                            events.put(("submitted", i, replace(piece, samples=NO_SAMPLES, features=None), fut))
                        fut.add_done_callback(settled(i, piece.duration))
                        n += 1
                    events.put(("end", i, n, source.duration))
                except AudioError as exc:
                    events.put(("failed", i, str(exc)))
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it
            events.put(("crashed", exc))

    thread = threading.Thread(target=produce, name="qasr-decode", daemon=True)
    states: dict[int, _Input] = {}
    finished: set[int] = set()
    thread.start()
    try:
        while len(finished) < count:
            if stop is not None and stop.is_set():
                return
            try:
                event = events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            kind = event[0]
            if kind == "crashed":
                raise event[1]
            i = event[1]
            if i in finished:
                continue  # a failed input's cancelled piece
            st = states.setdefault(i, _Input())
            if kind == "submitted":
                st.pieces.append(event[2])
                st.futures.append(event[3])
            elif kind == "settled":
                st.settled += 1
                if progress is not None:
                    progress(event[2])
            elif kind == "end":
                st.total, st.duration = event[2], event[3]
            elif kind == "failed":
                st.error = event[2]
                for fut in st.futures:
                    fut.cancel()
            if piece_done is not None and st.error is None:
                while st.shown < len(st.futures) and st.futures[st.shown].done():
                    st.shown += 1
                    yield i, piece_done(i, st.pieces[st.shown - 1], st.futures[st.shown - 1])
            if st.error is None and (st.total is None or st.settled < st.total):
                continue
            finished.add(i)
            del states[i]
            if st.error is not None:
                yield i, fail(i, st.error)
            else:
                # the silence left out is done too
                skipped = st.duration - sum(p.duration for p in st.pieces)
                if progress is not None and skipped > 0:
                    progress(skipped)
                yield i, finish(i, st.pieces, st.futures, st.duration)
    finally:
        with handover:
            halt.set()
        budget.wake()
        for st in states.values():
            for fut in st.futures:
                fut.cancel()
        while True:  # requests submitted after the last event we read
            try:
                event = events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "submitted":
                event[3].cancel()
        # a thread left in native code at exit aborts the process
        thread.join(_JOIN_S)
