"""Tokens from the engine thread to the event loop, one loop wake-up per burst instead of one per token.

A streamed request gets its tokens on the engine thread, one per step, and every running stream gets one
in the same step. Handing each over with its own ``call_soon_threadsafe`` wakes the loop once per token
(a pipe write, an epoll return, a callback), and on a machine with few cores that CPU comes straight out
of the engine's. Here the engine thread appends to a shared list and schedules one drain only when none
is pending, so a step's tokens for all streams reach their queues in one callback.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class TokenHandoff:
    """Delivers ``(queue, token)`` pairs posted from any thread into asyncio queues on ``loop``, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, int | None]] = []
        self._scheduled = False

    def sender(self, queue: asyncio.Queue) -> Callable[[int | None], None]:
        """An engine ``on_token`` callback that feeds ``queue`` (a token, then None at the end)."""
        return lambda token: self.post(queue, token)

    def post(self, queue: asyncio.Queue, token: int | None) -> None:
        with self._lock:
            self._pending.append((queue, token))
            if self._scheduled:
                return  # the drain already scheduled will take this one too
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed (server shut down): nobody is left to read the tokens
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        for queue, token in batch:
            queue.put_nowait(token)
