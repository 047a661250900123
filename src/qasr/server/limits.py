"""Admission by queued audio: requests whose audio would push the backlog past the limit get 429.

The backlog is the audio admitted and not yet transcribed. Retry-After estimates how long the excess
takes to clear at the throughput measured over the last minute.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from qasr.server.errors import ApiError

WINDOW_S = 60.0


class AudioBudget:
    def __init__(self, max_queued_s: float) -> None:
        self.max_queued_s = max_queued_s
        self._queued = 0.0
        self._lock = threading.Lock()
        self._done: deque[tuple[float, float]] = deque()  # (time, audio seconds) of finished requests

    @property
    def queued_s(self) -> float:
        return self._queued

    def admit(self, seconds: float) -> Ticket:
        """Reserve ``seconds`` of backlog or raise a 429 ApiError with Retry-After. A request is always
        admitted into an empty backlog, so one file longer than the limit is slow, never refused forever."""
        with self._lock:
            if self._queued > 0 and self._queued + seconds > self.max_queued_s:
                wait = self._retry_after(self._queued + seconds - self.max_queued_s)
                raise ApiError(429, f"the server's queue is full ({self._queued:.0f} s of audio waiting, limit "
                                    f"{self.max_queued_s:g} s); retry in {wait} s", code="rate_limit_exceeded",
                               headers={"Retry-After": str(wait)})
            self._queued += seconds
        return Ticket(self, seconds)

    def release(self, seconds: float, transcribed: bool) -> None:
        now = time.monotonic()
        with self._lock:
            self._queued -= seconds
            if self._queued < 1e-6:  # float sums drift: an empty backlog reads exactly 0
                self._queued = 0.0
            if transcribed:
                self._done.append((now, seconds))
            while self._done and now - self._done[0][0] > WINDOW_S:
                self._done.popleft()

    def _retry_after(self, excess_s: float) -> int:
        now = time.monotonic()
        recent = sum(s for t, s in self._done if now - t <= WINDOW_S)
        if recent <= 0:
            return 1
        rate = recent / WINDOW_S  # audio seconds transcribed per wall second
        return max(1, min(math.ceil(excess_s / rate), 600))


class Ticket:
    """One request's share of the backlog; releasing twice is harmless (a stream ends on several paths)."""

    def __init__(self, budget: AudioBudget, seconds: float) -> None:
        self._budget = budget
        self.seconds = seconds
        self._open = True

    def release(self, transcribed: bool) -> None:
        if self._open:
            self._open = False
            self._budget.release(self.seconds, transcribed)
