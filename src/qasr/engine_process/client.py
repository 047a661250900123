"""The server's side of the engine process: ``EngineProcess`` starts it, watches it and starts a new one when it
dies or stops stepping; ``RemoteEngine`` is an engine of it as the server's code uses an ``Engine``;
``RemoteTurn`` a live turn whose engine half runs there (docs/server.md, "The engine process")."""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from qasr.audio.features import FeatureConfig, LogMel
from qasr.engine.config import EngineConfig, EngineStats
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.engine.request import RequestSpec
from qasr.engine_process import child
from qasr.engine_process.child import EngineSpec
from qasr.engine_process.protocol import (
    Abort,
    Align,
    Call,
    Close,
    Closed,
    Done,
    EngineInfo,
    Generate,
    LoadFailed,
    Ready,
    Role,
    Stats,
    Tokens,
    TurnClose,
    TurnFinish,
    TurnOpen,
    TurnPush,
    Work,
)
from qasr.engine_process.shared_array import discard, share
from qasr.streaming.config import StreamConfig
from qasr.streaming.pcm import as_float_pcm
from qasr.streaming.session import Update

log = logging.getLogger("qasr.server")
POLL_S = 0.05
RESTART_BACKOFF_S = (1.0, 30.0)  # the wait before a new engine process after one failed to load: first, most
STEADY_S = 60.0  # an engine process that served this long resets the backoff


@dataclass(eq=False)
class _Pending:
    future: Future
    on_token: Callable[[int | None], None] | None
    shared: tuple[object, ...] = ()


@dataclass
class _Child:
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection
    stats_at: float = field(default_factory=time.monotonic)
    # what goes to it, sent by one thread of its own: a caller never waits on the pipe (one the engine process
    # does not read, e.g. while it hangs holding its GIL, would block the event loop until it is killed)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    writer: threading.Thread | None = None

    def send(self, message: object) -> None:
        """Queue ``message`` for the writer; pickled here, so one that does not pickle fails its caller."""
        self.outbox.put(None if message is None else ForkingPickler.dumps(message))

    def write(self) -> None:
        """The writer thread: send what is queued, in order, until a None or the pipe fails (the engine process
        is gone; the supervisor fails the calls in flight)."""
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - broken pipe, or closed under us
                return


class EngineProcess:
    """One engine process at a time, restarted whenever it dies (a crash, an OOM kill) or has work in hand and
    makes no step for ``timeout_s``: every call in flight then fails at once with EngineBroken."""

    def __init__(self, spec: EngineSpec, timeout_s: float = 60.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.restarts = 0
        self.lost = 0  # engine processes that ended while serving (counted at once; restarts when replaced)
        self.info: dict[str, EngineInfo] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # _pending and _child
        self._pending: dict[int, _Pending] = {}
        self._child: _Child | None = None  # set while ready
        self._spawned: _Child | None = None  # the last one started, ready or not
        self._stats: dict[str, EngineStats] = {}
        self._closing = False
        self._closed: set[str] = set()  # engines asked to close
        self._said_closed: set[str] = set()  # engines the engine process closed
        self._first: Future = Future()
        self._thread = threading.Thread(target=self._supervise, name="qasr-engine-supervisor", daemon=True)

    def start(self) -> dict[str, EngineInfo]:
        """Start the engine process and wait until it is ready; raises RuntimeError when it fails to load."""
        atexit.register(self._end_at_exit)
        self._thread.start()
        return self._first.result()

    @property
    def ready(self) -> bool:
        return self._child is not None

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def pid(self) -> int | None:
        child_ = self._child
        return None if child_ is None else child_.process.pid

    def stats(self, role: str) -> EngineStats | None:
        """The engine's last snapshot; None while no engine process is ready."""
        return self._stats.get(role) if self.ready else None

    def call(self, work: Work, on_token: Callable[[int | None], None] | None = None,
             shared: Sequence[object] = ()) -> Future:
        """Send ``work`` (never waiting on the pipe); the future resolves to its answer. Cancelling it aborts the
        call. Raises EngineBroken while no engine process is ready, EngineClosed once closing."""
        return self.call_with_id(work, on_token, shared)[1]

    def call_with_id(self, work: Work, on_token: Callable[[int | None], None] | None = None,
                     shared: Sequence[object] = (), restarts: int | None = None) -> tuple[int, Future]:
        """``call``, and the call's id (a turn's id is the id of its TurnOpen). ``restarts``: raise EngineBroken
        unless the engine process is the one that ran at that count of restarts (a live turn's own)."""
        try:
            with self._lock:
                if self._closing:
                    raise EngineClosed("the engine is closed")
                target = self._child
                if target is None:
                    raise EngineBroken("the engine process is not running (a new one is starting after a failure)")
                if restarts is not None and restarts != self.restarts:
                    raise EngineBroken("the engine process of this live turn ended (a new one serves new turns)")
                call_id = next(self._ids)
                future: Future = Future()
                self._pending[call_id] = _Pending(future, on_token, tuple(shared))
            try:
                target.send(Call(call_id, work))
            except BaseException:
                with self._lock:
                    self._pending.pop(call_id, None)
                raise
        except BaseException:
            for item in shared:  # refused: no engine process will take them
                discard(item)
            raise
        future.add_done_callback(lambda f: f.cancelled() and self._abort(call_id))
        return call_id, future

    def close_role(self, role: Role, drain: bool = True, timeout: float | None = None) -> None:
        """Close one engine (``drain``: its work finishes); the process exits when the last one is closed."""
        with self._lock:
            target = self._child
            if role in self._closed:
                return
            self._closed.add(role)
            last = self._closed >= set(self.info)
            if last:
                self._closing = True
        if target is not None:
            target.send(Close(role, drain, timeout))
        if last:
            deadline = None if timeout is None else time.monotonic() + timeout + 5.0
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._kill()
            atexit.unregister(self._end_at_exit)

    def close(self) -> None:
        """Close every engine without draining."""
        for role in list(self.info) or ["asr"]:
            self.close_role(role, drain=False, timeout=10.0)  # type: ignore[arg-type]

    def _abort(self, call_id: int) -> None:
        target = self._child
        if target is not None:
            target.send(Abort(call_id))

    def _spawn(self) -> _Child:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=child.main, args=(theirs, self.spec), name="qasr-engine", daemon=True)
        process.start()
        theirs.close()
        target = _Child(process, ours)
        target.writer = threading.Thread(target=target.write, name="qasr-engine-sender", daemon=True)
        target.writer.start()
        self._spawned = target
        return target

    def _end_at_exit(self) -> None:
        """At interpreter exit without close(): kill the engine process. It ignores SIGTERM, which is how
        multiprocessing ends a daemon process at exit, so the exit would otherwise wait on it forever."""
        self._closing = True
        self._kill()

    def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self._closing:
            try:
                target = self._spawn()
            except Exception as exc:  # noqa: BLE001 - e.g. no memory or file descriptors left: tried again later
                target, failure = None, f"it could not be started ({exc!r})"
            else:
                failure = self._await_ready(target)
            if failure is not None:
                if target is not None:
                    if self._closing:
                        target.process.kill()  # still loading: it reads no pipe, so it would not see ours close
                    self._reap(target)
                if not self._first.done():
                    self._first.set_exception(RuntimeError(f"the engine process failed to start: {failure}"))
                    return
                if self._closing:
                    return
                log.error("the engine process failed to start (%s); trying again in %.0f s", failure, backoff)
                time.sleep(backoff)
                backoff = min(2 * backoff, RESTART_BACKOFF_S[1])
                continue
            started = time.monotonic()
            with self._lock:
                self._child = target
            if not self._first.done():
                self._first.set_result(self.info)
            else:
                log.warning("a new engine process (pid %d) is ready", target.process.pid)
            why = self._serve(target)
            with self._lock:
                self._child = None
                pending, self._pending = self._pending, {}
                self.lost += not self._closing
            self._reap(target)
            error = EngineBroken(f"the engine process {why}; the server is starting a new one")
            if self._closing:
                error = EngineClosed(f"the engine was closed before this request finished ({why})")
            for entry in pending.values():
                _settle(entry, error=error)
                for item in entry.shared:
                    discard(item)
            if self._closing:
                return
            self.restarts += 1
            log.error("the engine process %s: failing %d calls in flight, starting a new one", why, len(pending))
            if time.monotonic() - started > STEADY_S:
                backoff = RESTART_BACKOFF_S[0]

    def _await_ready(self, target: _Child) -> str | None:
        """None once it has said Ready and sent its first Stats (stats() has a snapshot as soon as ``ready``),
        else why it will not."""
        conn = target.conn
        info: dict[str, EngineInfo] | None = None
        while True:
            if self._closing:
                return "closed while starting"
            try:
                if conn.poll(POLL_S):  # type: ignore[attr-defined]
                    for message in conn.recv():  # type: ignore[attr-defined]
                        if isinstance(message, Ready):
                            info = message.engines
                        elif isinstance(message, Stats) and info is not None:
                            # the last process's snapshot (broken, stalled) is replaced before this one serves
                            self.info, self._stats = info, message.engines
                            target.stats_at = time.monotonic()
                            return None
                        elif isinstance(message, LoadFailed):
                            return message.error
            except (EOFError, OSError):
                pass
            if not target.process.is_alive():
                return f"it exited with code {target.process.exitcode} while loading"

    def _serve(self, target: _Child) -> str:
        """Route its answers until it ends or is given up on; says what happened."""
        conn = target.conn
        while True:
            try:
                while conn.poll(POLL_S):  # type: ignore[attr-defined]
                    messages = conn.recv()  # type: ignore[attr-defined]
                    for message in messages:
                        self._route(target, message)
                    if self._said_closed >= set(self.info):
                        return "was closed"
            except (EOFError, OSError):
                target.process.join(2.0)
                return _exit_words(target.process.exitcode)
            if not target.process.is_alive():
                return _exit_words(target.process.exitcode)
            trouble = self._trouble(target)
            if trouble is not None:
                log.error("the engine process %s: killing it", trouble)
                target.process.kill()
                return trouble

    def _route(self, target: _Child, message: object) -> None:
        if isinstance(message, Tokens):
            for call_id, token in message.items:
                entry = self._pending.get(call_id)
                if entry is not None and entry.on_token is not None:
                    try:
                        entry.on_token(token)
                    except Exception as exc:  # noqa: BLE001 - a listener that raises ends its own call
                        log.warning("a token listener failed (%r); cancelling its request", exc)
                        entry.on_token = None
                        entry.future.cancel()
        elif isinstance(message, Done):
            with self._lock:
                entry = self._pending.pop(message.id, None)
            if entry is not None:
                for item in entry.shared:
                    discard(item)  # taken already unless the call was refused
                _settle(entry, message.value, message.error)
        elif isinstance(message, Stats):
            self._stats = message.engines
            target.stats_at = time.monotonic()
        elif isinstance(message, Closed):
            self._said_closed.add(message.role)

    def _trouble(self, target: _Child) -> str | None:
        """Why the engine process should be given up on, or None."""
        quiet = time.monotonic() - target.stats_at
        if quiet > self.timeout_s:
            return f"sent nothing for {quiet:.0f} s"
        for role, stats in self._stats.items():
            if stats.broken and role not in self._closed:
                return f"reports its {role} engine broken"
            if stats.stalled_s > self.timeout_s:
                return f"has had work in hand for {stats.stalled_s:.0f} s without a step ({role} engine)"
        return None

    def _reap(self, target: _Child) -> None:
        """Stop its writer, close the pipe (an engine process still reading it exits), then make sure it is gone."""
        target.send(None)
        if target.writer is not None:
            target.writer.join(2.0)
            if target.writer.is_alive():  # blocked on a pipe the engine process does not read: it goes first
                target.process.kill()
                target.writer.join(5.0)
        try:
            target.conn.close()  # type: ignore[attr-defined]
        except OSError:
            pass
        target.process.join(2.0)
        if target.process.is_alive():
            target.process.kill()
            target.process.join(5.0)

    def _kill(self) -> None:
        """Kill the last engine process started, ready or still loading, if it is alive."""
        target = self._spawned
        if target is not None and target.process.is_alive():
            target.process.kill()


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited (code {code})"


def _settle(entry: _Pending, value: object = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(value)
    except InvalidStateError:
        pass  # cancelled here first
    listener, entry.on_token = entry.on_token, None
    if listener is not None:
        try:
            listener(None)
        except Exception as exc:  # noqa: BLE001
            log.warning("a token listener failed at its end (%r)", exc)


class RemoteEngine:
    """An engine of the engine process, used as an ``Engine``: ``submit``, ``submit_alignment``, ``stats``,
    ``close``. Requests carry their own audio (no ``audio_embeds``, no KV continuation: live turns run in the
    engine process, see ``open_turn``)."""

    def __init__(self, process: EngineProcess, role: Role, features: FeatureConfig) -> None:
        self.process = process
        self.role = role
        info = process.info[role]
        self.config: EngineConfig = info.config
        self.description = info.description
        # the server makes log-mel features where the engine would make them on its CPU
        self.log_mel = LogMel(features, "cpu") if info.cpu_features else None

    @property
    def ready(self) -> bool:
        return self.process.ready

    @property
    def restarts(self) -> int:
        return self.process.restarts

    def submit(self, spec: RequestSpec, on_token: Callable[[int | None], None] | None = None) -> Future:
        """``Engine.submit`` through the engine process; its refusals come as the future's error."""
        if spec.audio_embeds is not None or spec.continuation.keep_kv or spec.continuation.kv_prefix is not None:
            raise ValueError("an engine in another process takes requests with their own audio and no KV "
                             "continuation (live turns: open_turn)")
        features = spec.features
        if features is None and spec.waveform is not None and self.log_mel is not None:
            features = self.log_mel(spec.waveform)
        audio = share(features if features is not None else _waveform(spec.waveform))
        group = None if spec.group is None else hash(spec.group)
        work = Generate(list(spec.prompt), spec.max_new_tokens, audio, features is not None, spec.ignore_eos,
                        spec.interactive, group, on_token is not None)
        return self.process.call(work, on_token, shared=(audio,))

    def submit_alignment(self, prompt: list[int], *, positions: Sequence[int], waveform: np.ndarray | None = None,
                         features: torch.Tensor | None = None) -> Future:
        """``Engine.submit_alignment`` through the engine process."""
        if features is None and waveform is not None and self.log_mel is not None:
            features = self.log_mel(waveform)
        audio = share(features if features is not None else _waveform(waveform))
        work = Align([int(t) for t in prompt], [int(p) for p in positions], audio, features is not None)
        return self.process.call(work, shared=(audio,))

    def open_turn(self, config: StreamConfig) -> RemoteTurn:
        """A live turn whose streaming session runs in the engine process."""
        return RemoteTurn(self.process, config)

    def stats(self) -> EngineStats:
        """The engine's last snapshot; while no engine process is ready, an empty one marked broken."""
        stats = self.process.stats(self.role)
        if stats is None:
            return EngineStats(0, 0, 0, 0, 0, 0, self.config.kv_block_tokens, 0, 0, 0, 0.0, broken=True,
                               closed=self.process.closing)
        return stats

    def release_caller_threads(self) -> None:
        """Nothing to free: the server process's torch runs one thread."""

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        self.process.close_role(self.role, drain, timeout)


class RemoteTurn:
    """A live turn (``streaming.Session``'s push / finish / close) run in the engine process; only PCM goes there
    and only Updates come back. A session steps only at whole chunks, so PCM is held here until it completes one:
    a push of a 32 ms frame costs no round trip."""

    def __init__(self, process: EngineProcess, config: StreamConfig) -> None:
        self.process = process
        self.config = config
        self.samples = 0
        self.finished = False
        self._held: list[np.ndarray] = []
        self._sent = 0  # samples the engine process has
        self._restarts = process.restarts  # its engine process: after a restart, the turn is gone
        turn, future = process.call_with_id(TurnOpen(config), restarts=self._restarts)
        future.result()  # opened as the engine process reads it: no step to wait for
        self._id: int | None = turn

    def push(self, pcm: np.ndarray) -> list[Update]:
        if self.finished:
            raise RuntimeError("the session is finished")
        x = as_float_pcm(pcm)
        self.samples += x.size
        self._held.append(x)
        chunk = self.config.chunk_size_samples
        if self.samples // chunk == self._sent // chunk:  # no chunk completes: the session would not step
            return []
        return self._send_held().result()

    def finish(self) -> Update:
        if self.finished:
            raise RuntimeError("the session is finished")
        self.finished = True
        if self._held:
            self._send_held()  # completes no chunk (no update); the engine process runs a turn's calls in order
        return self._call(TurnFinish(self._turn)).result()

    def _send_held(self) -> Future:
        pcm = np.concatenate(self._held) if len(self._held) > 1 else self._held[0]
        self._held = []
        self._sent = self.samples
        return self._call(TurnPush(self._turn, pcm))

    def close(self) -> None:
        if self._id is None:
            return
        turn, self._id = self._id, None
        if not self.finished:
            try:
                self._call(TurnClose(turn))
            except (EngineBroken, EngineClosed):
                pass  # the turn went with its engine process

    def _call(self, work: Work) -> Future:
        return self.process.call_with_id(work, restarts=self._restarts)[1]

    @property
    def _turn(self) -> int:
        if self._id is None:
            raise RuntimeError("the live turn is closed")
        return self._id


def _waveform(waveform: np.ndarray | None) -> np.ndarray:
    if waveform is None:
        raise ValueError("a request needs audio: waveform or features")
    return np.asarray(waveform, dtype=np.float32)
