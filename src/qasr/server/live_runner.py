"""One WebSocket connection's live session, run off the event loop.

Both protocols (OpenAI Realtime and the native one) parse their messages into the same few operations:
audio, commit, clear, finish. Operations run in arrival order on a worker thread (one at a time: a
``LiveSession`` is driven by one thread), and the events each one produced go back to the protocol's
``emit`` in that order. The worker thread computes log-mel frames and waits; the encoder windows and the
decoder steps run on the shared engine, where every session's work batches with the others' and with file
transcriptions.

Flow control, not data loss: audio received and not yet processed (the backlog) is counted, and while it
is at ``max_backlog_s`` the connection reads no further message (``has_room``), so a client that sends
faster than the server transcribes is slowed down by TCP instead of having audio dropped; memory stays
bounded by the backlog plus one message. So that a client can pace itself without ever filling the
backlog (its pings then never wait behind audio), ``progress`` reports the audio processed after every
``progress_every_s`` of it.
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
PROGRESS_EVERY_S = 1.0  # a client learns what was processed at least this often (in audio seconds)
CHUNK = SAMPLE_RATE  # audio is queued in chunks of at most 1 s (the default step)


_background: set[asyncio.Future] = set()  # closes still running after their session answered its client


def _closed(closing: asyncio.Future) -> None:
    _background.discard(closing)
    if not closing.cancelled() and closing.exception() is not None:  # the engine may be closed by now
        log.debug("an abandoned live session's close failed: %r", closing.exception())


class LiveRunner:
    def __init__(self, session: LiveSession, ingest: PcmIngest, emit: Callable[[Op, list[LiveEvent]], Awaitable[None]],
                 fail: Callable[[Exception], Awaitable[None]], max_backlog_s: float, executor: Executor,
                 progress: Callable[[], Awaitable[None]] | None = None) -> None:
        """``emit(op, events)`` gets each operation's events; ``fail(exc)`` an operation's exception (the
        session is closed after it and later operations are dropped); ``progress()`` is called after every
        ``progress_every_s`` of audio processed. Operations and the close run on ``executor`` (the
        server's live-session pool, apart from upload decoding)."""
        self.session = session
        self._executor = executor
        self.ingest = ingest
        self._emit = emit
        self._fail = fail
        self._progress = progress
        self.max_backlog_s = max_backlog_s
        self._max_backlog = int(max_backlog_s * SAMPLE_RATE)
        # reports come at least twice per backlog, so a client keeping half the backlog in flight never stalls
        self._progress_every = int(min(PROGRESS_EVERY_S, max_backlog_s / 4) * SAMPLE_RATE)
        self._reported = 0  # audio_samples at the last progress report
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

    def has_room(self) -> bool:
        """Whether the connection may read its next message: the backlog is under its limit (a message
        larger than the whole limit is still taken, alone)."""
        return self.backlog < self._max_backlog or self.failed or self._abandoned

    def audio(self, pcm: bytes) -> None:
        """Queue wire PCM (raises ValueError for samples that are not audio: NaN, infinite), in chunks of
        at most ``CHUNK`` samples: a session is abandoned (a cut drain) between chunks, not after a long
        message."""
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
        """``finish()``, unless ``cut`` is set first: then abandon (``close()``). True when it finished."""
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
        # the client hears now; the piece being processed ends in the background (the engine, closed
        # after a cut drain, fails it at once), then the session's engine state is freed
        closing = asyncio.ensure_future(self.close())
        _background.add(closing)
        closing.add_done_callback(_closed)
        return False

    async def close(self) -> None:
        """Abandon: skip what is queued, stop the worker, free the session's engine state."""
        self._abandoned = True
        self._queue.put_nowait(None)
        await asyncio.gather(self._worker, return_exceptions=True)
        await self._off_loop(self.session.close)

    async def _run(self) -> None:
        while (item := await self._queue.get()) is not None:
            op, samples = item
            if self.failed or self._abandoned:
                continue
            self._working = True
            try:
                events = await self._off_loop(functools.partial(self._apply, op, samples))
            except Exception as exc:  # noqa: BLE001 - reported to the client, then the session is closed
                if self._abandoned:  # e.g. a cut drain closed the engine under it: its client was told already
                    log.debug("an abandoned live session's last operation failed: %r", exc)
                    continue
                log.exception("live session failed")
                self.failed = True
                await self._off_loop(self.session.close)
                await self._fail(exc)
                continue
            finally:
                self._working = False
                if samples is not None:  # counted here, on the event loop's thread, like the additions
                    self.backlog -= samples.size
                    self.audio_samples += samples.size
            if self._abandoned:  # closed while this operation ran: its client hears no more of it
                continue
            await self._emit(op, events)
            if self._progress is not None and self.audio_samples - self._reported >= self._progress_every:
                self._reported = self.audio_samples
                await self._progress()

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
