"""One WebSocket connection's live session, run off the event loop.

Both protocols (OpenAI Realtime and the native one) parse their messages into the same few operations:
audio, commit, clear, finish. Operations run in arrival order on a worker thread (one at a time: a
``LiveSession`` is driven by one thread), and the events each one produced go back to the protocol's
``emit`` in that order. Encoding runs on the worker thread; decoding runs on the shared engine, where the
steps of every session batch with each other and with file transcriptions.

Backlog policy: audio received but not yet processed is counted; an append that would take it past
``max_backlog_s`` is refused (the protocol reports an error and the samples are dropped), so a client
that sends faster than the server keeps up is told so instead of growing the server's memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import numpy as np

from qasr.audio.io import SAMPLE_RATE
from qasr.streaming.ingest import PcmIngest
from qasr.streaming.live import LiveEvent, LiveSession

log = logging.getLogger("qasr.server")
Op = Literal["audio", "commit", "clear", "finish"]


class BacklogFull(Exception):
    """The client sends audio faster than it is transcribed."""


class LiveRunner:
    def __init__(self, session: LiveSession, ingest: PcmIngest, emit: Callable[[Op, list[LiveEvent]], Awaitable[None]],
                 fail: Callable[[Exception], Awaitable[None]], max_backlog_s: float) -> None:
        """``emit(op, events)`` gets each operation's events; ``fail(exc)`` an operation's exception (the
        session is closed after it and later operations are dropped)."""
        self.session = session
        self.ingest = ingest
        self._emit = emit
        self._fail = fail
        self._max_backlog = int(max_backlog_s * SAMPLE_RATE)
        self.backlog = 0  # samples queued and not yet processed
        self.audio_samples = 0  # samples processed (16 kHz)
        self._queue: asyncio.Queue[tuple[Op, np.ndarray | None] | None] = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())
        self.failed = False
        self._abandoned = False
        self._working = False  # an operation is being applied

    @property
    def busy(self) -> bool:
        """Work is queued or running (a client waiting for it is not idle)."""
        return self._working or not self._queue.empty()

    def audio(self, pcm: bytes) -> None:
        """Queue wire PCM; raises BacklogFull (nothing queued) past the backlog limit."""
        samples = self.ingest.feed(pcm)
        if self.backlog + samples.size > self._max_backlog:
            limit = self._max_backlog / SAMPLE_RATE
            raise BacklogFull(f"audio arrives faster than it is transcribed: over {limit:g} s are waiting; "
                              "this append was dropped")
        self.backlog += samples.size
        self._queue.put_nowait(("audio", samples))

    def commit(self) -> None:
        self._queue.put_nowait(("commit", None))

    def clear(self) -> None:
        self._queue.put_nowait(("clear", None))

    async def finish(self) -> None:
        """Process everything queued, end the open turn, and stop."""
        tail = self.ingest.flush()
        if tail.size:
            self.backlog += tail.size
            self._queue.put_nowait(("audio", tail))
        self._queue.put_nowait(("finish", None))
        self._queue.put_nowait(None)
        await asyncio.shield(self._worker)

    async def close(self) -> None:
        """Abandon: skip what is queued, stop the worker, free the session's engine state."""
        self._abandoned = True
        self._queue.put_nowait(None)
        await asyncio.gather(self._worker, return_exceptions=True)
        await asyncio.to_thread(self.session.close)

    async def _run(self) -> None:
        while (item := await self._queue.get()) is not None:
            op, samples = item
            if self.failed or self._abandoned:
                continue
            self._working = True
            try:
                events = await asyncio.to_thread(self._apply, op, samples)
            except Exception as exc:  # noqa: BLE001 - reported to the client, then the session is closed
                log.exception("live session failed")
                self.failed = True
                await asyncio.to_thread(self.session.close)
                await self._fail(exc)
                continue
            finally:
                self._working = False
            await self._emit(op, events)

    def _apply(self, op: Op, samples: np.ndarray | None) -> list[LiveEvent]:
        if op == "audio":
            assert samples is not None
            self.backlog -= samples.size
            self.audio_samples += samples.size
            return self.session.push(samples)
        if op == "commit":
            return self.session.commit()
        if op == "clear":
            self.session.clear()
            return []
        return self.session.finish()
