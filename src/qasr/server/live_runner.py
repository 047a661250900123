"""One WebSocket connection's live session, its operations run in order on a worker thread.

While the backlog (audio taken, not yet processed) is at ``max_backlog_s`` the session takes no
message (``has_room``): the connection reads ahead to a bound, then TCP slows the client; no audio is
dropped. A client that cannot be sent to is gone: its session is abandoned and freed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Literal, TypeVar

import numpy as np

from qasr.audio.io import SAMPLE_RATE
from qasr.streaming.ingest import PcmIngest
from qasr.streaming.live import LiveEvent, LiveSession

log = logging.getLogger("qasr.server")
Op = Literal["audio", "commit", "clear", "finish"]
T = TypeVar("T")
PROGRESS_EVERY_S = 1.0  # audio seconds between progress reports, at most
CHUNK = SAMPLE_RATE  # audio is queued in chunks of at most 1 s


_background: set[asyncio.Future] = set()  # closes still running after their client was answered


def _closed(closing: asyncio.Future) -> None:
    _background.discard(closing)
    if not closing.cancelled() and closing.exception() is not None:  # the engine may be closed by now
        log.debug("an abandoned live session's close failed: %r", closing.exception())


class LiveRunner:
    def __init__(self, session: LiveSession, ingest: PcmIngest, emit: Callable[[Op, list[LiveEvent]], Awaitable[None]],
                 fail: Callable[[Exception], Awaitable[None]], max_backlog_s: float, executor: Executor,
                 progress: Callable[[], Awaitable[None]] | None = None) -> None:
        """``emit(op, events)`` gets each operation's events; ``fail(exc)`` an operation's exception (the
        session is then closed); ``progress()`` comes every ``PROGRESS_EVERY_S`` of audio processed."""
        self.session = session
        self._executor = executor
        self.ingest = ingest
        self._emit = emit
        self._fail = fail
        self._progress = progress
        self.max_backlog_s = max_backlog_s
        self._max_backlog = int(max_backlog_s * SAMPLE_RATE)
        # at least two reports per backlog: a client keeping half of it in flight never stalls
        self._progress_every = int(min(PROGRESS_EVERY_S, max_backlog_s / 4) * SAMPLE_RATE)
        self._reported = 0  # audio_samples at the last progress report
        self.backlog = 0  # samples queued and not yet processed
        self.audio_samples = 0  # samples processed (16 kHz)
        self._queue: asyncio.Queue[tuple[Op, np.ndarray | None] | None] = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())
        self.failed = False
        self._abandoned = False
        self._working = False
        self._closing: asyncio.Future | None = None

    @property
    def busy(self) -> bool:
        """Work is queued or running (the client is not idle)."""
        return not self._worker.done() and (self._working or not self._queue.empty())

    def has_room(self) -> bool:
        """Whether the connection may take its next message (the backlog is under its limit)."""
        return self.backlog < self._max_backlog or self.failed or self._abandoned or self._worker.done()

    def audio(self, pcm: bytes) -> None:
        """Queue wire PCM in chunks of ``CHUNK`` samples; ValueError for samples that are not audio."""
        samples = self.ingest.feed(pcm)
        self.backlog += samples.size
        for i in range(0, samples.size, CHUNK):
            self._queue.put_nowait(("audio", samples[i:i + CHUNK]))

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

    async def finish_by(self, cut: asyncio.Event) -> bool:
        """``finish()``, unless ``cut`` is set first: then abandon. True when it finished."""
        finishing = asyncio.ensure_future(self.finish())
        stop = asyncio.ensure_future(cut.wait())
        try:
            await asyncio.wait({finishing, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if finishing.done():
            finishing.result()
            return True
        finishing.cancel()  # only the shield: the worker is stopped below
        # the client hears now; the close finishes in the background
        closing = self._close_soon()
        _background.add(closing)
        closing.add_done_callback(_closed)
        return False

    @property
    def closing(self) -> bool:
        return self._closing is not None

    async def close(self) -> None:
        """Abandon: skip what is queued, stop the worker, free the session's engine state (idempotent)."""
        await asyncio.shield(self._close_soon())

    def _close_soon(self) -> asyncio.Future:
        if self._closing is None:
            self._abandoned = True
            self._queue.put_nowait(None)
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def _close(self) -> None:
        await asyncio.gather(self._worker, return_exceptions=True)
        await self._free()

    async def _free(self) -> None:
        try:
            await self._off_loop(self.session.close)
        except Exception as exc:  # noqa: BLE001 - the pool is shut down at exit
            log.debug("a live session's close failed: %r", exc)

    async def _run(self) -> None:
        try:
            while (item := await self._queue.get()) is not None:
                op, samples = item
                if self.failed or self._abandoned:
                    continue
                self._working = True
                try:
                    events = await self._off_loop(functools.partial(self._apply, op, samples))
                except Exception as exc:  # noqa: BLE001 - reported to the client
                    if self._abandoned:  # e.g. a cut drain closed the engine: the client was told
                        log.debug("an abandoned live session's last operation failed: %r", exc)
                        continue
                    log.exception("live session failed")
                    self.failed = True
                    await self._free()
                    await self._tell(self._fail(exc))
                    continue
                finally:
                    self._working = False
                    if samples is not None:  # on the loop's thread, like the additions
                        self.backlog -= samples.size
                        self.audio_samples += samples.size
                if not self._abandoned:  # (closed while this operation ran)
                    await self._tell(self._report(op, events))
        finally:
            self._working = False

    async def _report(self, op: Op, events: list[LiveEvent]) -> None:
        await self._emit(op, events)
        if self._progress is not None and self.audio_samples - self._reported >= self._progress_every:
            self._reported = self.audio_samples
            await self._progress()

    async def _tell(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        except Exception as exc:  # noqa: BLE001
            if not self._abandoned:
                log.debug("a live session's client is gone: %r", exc)
                self._abandoned = True
                await self._free()

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _apply(self, op: Op, samples: np.ndarray | None) -> list[LiveEvent]:
        if op == "audio":
            assert samples is not None
            return self.session.push(samples)
        if op == "commit":
            return self.session.commit()
        if op == "clear":
            self.session.clear()
            return []
        return self.session.finish()
