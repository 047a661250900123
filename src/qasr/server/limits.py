"""Admission by queued audio: a request that would push the backlog (admitted, not yet transcribed)
past the limit gets 429. An upload is admitted by its probed duration and held to it while decoding.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from qasr.audio.io import AudioError
from qasr.audio.probe import Duration
from qasr.server.errors import ApiError

WINDOW_S = 60.0
# how far decoded audio may pass a stated duration (containers round, FFmpeg estimates from the bitrate)
SLACK_FRACTION = 0.02
SLACK_S = 2.0
GROWTH = 0.25  # an estimate that runs short grows by this fraction of what is decoded, not block by block


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
        """Reserve ``seconds`` of backlog or raise a 429 ApiError with Retry-After; an empty backlog always admits."""
        with self._lock:
            self._check(self._queued, seconds)
            self._queued += seconds
        return Ticket(self, seconds)

    def grow(self, ticket: Ticket, seconds: float) -> None:
        """Add ``seconds`` to an admitted ticket by ``admit``'s rule, or raise its 429."""
        with self._lock:
            self._check(self._queued - ticket.seconds, ticket.seconds + seconds)
            self._queued += seconds
            ticket.seconds += seconds

    def resize(self, ticket: Ticket, seconds: float) -> None:
        """Set a ticket to the audio its upload really decoded to (never refused)."""
        with self._lock:
            self._queued = max(0.0, self._queued + seconds - ticket.seconds)
            ticket.seconds = seconds

    def _check(self, others: float, seconds: float) -> None:
        if others > 0 and others + seconds > self.max_queued_s:
            wait = self._retry_after(others + seconds - self.max_queued_s)
            raise ApiError(429, f"the server's queue is full ({others:.0f} s of audio waiting, limit "
                                f"{self.max_queued_s:g} s); retry in {wait} s", code="rate_limit_exceeded",
                           headers={"Retry-After": str(wait)})

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
    """One request's share of the backlog; releasing it twice is harmless."""

    def __init__(self, budget: AudioBudget, seconds: float) -> None:
        self._budget = budget
        self.seconds = seconds
        self._open = True

    def release(self, transcribed: bool) -> None:
        if self._open:
            self._open = False
            self._budget.release(self.seconds, transcribed)

    def resize(self, seconds: float) -> None:
        """Hold the audio the upload really decoded to."""
        if self._open:
            self._budget.resize(self, seconds)


class UploadAdmission:
    """One upload's ticket and the ``watch`` its decoding calls: past a stated duration (plus slack) it
    stops with 413, past an estimate it grows the ticket or stops with 429, after ``leave()`` at the next
    block. ``refusal``: the ApiError to answer with."""

    def __init__(self, budget: AudioBudget, duration: Duration, name: str) -> None:
        self.ticket = budget.admit(duration.seconds)  # the 429, before a sample is decoded
        self.budget = budget
        self.name = name
        self.declared = duration.declared
        self.stated_s = duration.seconds
        self.allowed_s = duration.seconds * (1 + SLACK_FRACTION) + SLACK_S
        self.refusal: ApiError | None = None
        self._left = threading.Event()

    def leave(self) -> None:
        self._left.set()

    def watch(self, seconds: float) -> None:
        """Called on the decoding thread with the seconds decoded so far in this pass."""
        if self._left.is_set():
            raise AudioError(f"{self.name}: decoding stopped: the client went away")
        if seconds <= self.allowed_s:
            return
        if self.declared:
            self.refusal = ApiError(
                413, f"{self.name}: decodes to more audio than its header states ({self.stated_s:.1f} s, what "
                     f"was admitted); decoding stopped at {seconds:.1f} s. Re-encode the file so its header is "
                     "right (e.g. ffmpeg -i IN OUT)", param="file", code="audio_too_long")
            raise AudioError(self.refusal.message)
        extra = seconds * (1 + GROWTH) - self.ticket.seconds
        try:
            self.budget.grow(self.ticket, extra)
        except ApiError as exc:
            self.refusal = exc
            raise AudioError(f"{self.name}: {exc.message}") from exc
        self.allowed_s = self.ticket.seconds
