"""The engine process: it loads the checkpoints, runs their engines and a live turn's engine half, and
answers the server through one pipe (protocol.py). It exits when the server is gone."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from qasr.engine.config import EngineConfig
from qasr.engine.engine import Engine, RequestSpec
from qasr.engine_process.protocol import (
    Abort,
    Align,
    Call,
    Close,
    Closed,
    Done,
    EngineInfo,
    FromEngine,
    Generate,
    LoadFailed,
    Ready,
    Stats,
    Tokens,
    TurnClose,
    TurnFinish,
    TurnOpen,
    TurnPush,
)
from qasr.engine_process.shared_array import received
from qasr.streaming.session import Session, Update

log = logging.getLogger("qasr.engine_process")
STATS_EVERY_S = 0.2


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads: the model (and an aligner) as ``ASR.from_pretrained`` would."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    aligner: str | None = None
    aligner_engine: EngineConfig = field(default_factory=EngineConfig)
    log_level: int = logging.INFO
    warmup: bool = True  # one short transcription before Ready, at every start


def main(conn: Connection, spec: EngineSpec) -> None:
    """The engine process's entry point (multiprocessing, spawn)."""
    _die_with_parent()
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s engine: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engines = _load(spec)
    except BaseException as exc:  # noqa: BLE001 - the server reports it
        log.exception("the engine process failed to load")
        with contextlib.suppress(Exception):
            conn.send([LoadFailed(f"{type(exc).__name__}: {exc}")])
        os._exit(1)
    Host(conn, engines).run()
    os._exit(0)


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux), e.g. when the server is killed."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def _load(spec: EngineSpec) -> dict[str, Engine]:
    from qasr.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(spec.model, device=spec.device, dtype=spec.dtype)
    engines = {"asr": Engine(checkpoint, spec.engine)}
    if spec.aligner is not None:
        aligner = load_checkpoint(spec.aligner, device=spec.device, dtype=spec.dtype)
        if not aligner.config.is_aligner:
            raise ValueError(f"{spec.aligner} is not a forced-aligner checkpoint (it looks like an ASR model)")
        engines["aligner"] = Engine(aligner, spec.aligner_engine)
    if spec.warmup:
        _warm_up(engines)
    return engines


def _warm_up(engines: dict[str, Engine]) -> None:
    """``warm_up`` over these engines, in this process: no client meets a cold engine process."""
    from qasr.align.aligner import Aligner
    from qasr.transcribe.asr import ASR
    from qasr.transcribe.core import Core
    from qasr.transcribe.warm_up import warm_up

    asr, aligner = engines["asr"], engines.get("aligner")
    started = time.perf_counter()
    words = None if aligner is None else Aligner(aligner.checkpoint, aligner)
    warm_up(ASR(asr.checkpoint, core=Core(asr.checkpoint, asr, words)))
    log.info("warmed up in %.1f s", time.perf_counter() - started)


class Host:
    """Serves the server's calls: the reading thread dispatches them, one writing thread sends every answer."""

    def __init__(self, conn: Connection, engines: dict[str, Engine]) -> None:
        self.conn = conn
        self.engines = engines
        self.out: queue.SimpleQueue[FromEngine] = queue.SimpleQueue()
        self.futures: dict[int, Future] = {}
        # id -> (streaming.Session, its thread): a turn's calls block on its engine requests and run in order
        self.turns: dict[int, tuple[Session, ThreadPoolExecutor]] = {}

    def run(self) -> None:
        writer = threading.Thread(target=self._write, name="qasr-engine-writer", daemon=True)
        writer.start()
        self.out.put(Ready({role: EngineInfo(e.config, e.prepared.description, e.log_mel is not None)
                            for role, e in self.engines.items()}))
        threading.Thread(target=self._stats, name="qasr-engine-stats", daemon=True).start()  # after Ready
        while True:  # the server closes the pipe once every engine is closed, or when it dies
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            self._take(message)

    def _take(self, message: object) -> None:
        if isinstance(message, Call):
            self._call(message)
        elif isinstance(message, Abort):
            future = self.futures.get(message.id)
            if future is not None:
                future.cancel()
        elif isinstance(message, Close):  # a drain takes time: the reading goes on meanwhile
            threading.Thread(target=self._close, args=(message,), name="qasr-engine-close", daemon=True).start()

    def _close(self, message: Close) -> None:
        if message.role == "asr":
            for turn, _ in list(self.turns.values()):
                with contextlib.suppress(Exception):
                    turn.close()
        engine = self.engines.get(message.role)
        if engine is not None:
            engine.close(message.drain, message.timeout_s)
        self.out.put(Closed(message.role))

    def _call(self, call: Call) -> None:
        work = call.work
        try:
            if isinstance(work, TurnOpen):  # quick; the turn's later calls queue on its own thread
                engine = self.engines["asr"]
                self.turns[call.id] = (Session(engine, engine.checkpoint, work.config),
                                       ThreadPoolExecutor(1, thread_name_prefix="qasr-turn"))
                self.out.put(Done(call.id))
                return
            if isinstance(work, Generate):
                future = self._generate(call.id, work)
            elif isinstance(work, Align):
                future = self._align(work)
            else:
                future = self._turn(work)
        except BaseException as exc:  # noqa: BLE001 - a refusal is the call's answer
            self.out.put(Done(call.id, error=_sendable(exc)))
            return
        self.futures[call.id] = future
        future.add_done_callback(lambda f, i=call.id: self._done(i, f))

    def _generate(self, call_id: int, work: Generate) -> Future:
        audio = torch.from_numpy(received(work.audio))
        spec = RequestSpec(work.prompt, work.max_new_tokens, ignore_eos=work.ignore_eos, interactive=work.interactive,
                           group=work.group, **({"features": audio} if work.features else {"waveform": audio.numpy()}))
        on_token = None
        if work.stream:
            def on_token(token: int | None) -> None:
                if token is not None:
                    self.out.put(Tokens([(call_id, token)]))
        return self.engines["asr"].submit(spec, on_token=on_token)

    def _align(self, work: Align) -> Future:
        engine = self.engines.get("aligner")
        if engine is None:
            raise ValueError("the engine process runs no aligner")
        audio = received(work.audio)
        if work.features:
            return engine.submit_alignment(list(work.prompt), positions=work.positions,
                                           features=torch.from_numpy(audio))
        return engine.submit_alignment(list(work.prompt), positions=work.positions, waveform=audio)

    def _turn(self, work: TurnPush | TurnFinish | TurnClose) -> Future:
        """Queue a call on its turn's thread; a finish or a close ends the turn."""
        if work.turn not in self.turns:
            raise RuntimeError(f"live turn {work.turn} is not open in the engine process")
        if isinstance(work, TurnPush):
            turn, thread = self.turns[work.turn]
            return thread.submit(turn.push, work.pcm)
        turn, thread = self.turns.pop(work.turn)
        future = thread.submit(_end_turn, turn, isinstance(work, TurnFinish))
        thread.shutdown(wait=False)
        return future

    def _done(self, call_id: int, future: Future) -> None:
        self.futures.pop(call_id, None)
        if future.cancelled():
            self.out.put(Done(call_id, error=_sendable(_Cancelled("cancelled"))))
            return
        error = future.exception()
        self.out.put(Done(call_id, error=_sendable(error)) if error is not None else Done(call_id, future.result()))

    def _stats(self) -> None:
        """A snapshot at once (the server counts the process ready with it), then every STATS_EVERY_S."""
        while True:
            self.out.put(Stats({role: e.stats() for role, e in self.engines.items()}))
            time.sleep(STATS_EVERY_S)

    def _write(self) -> None:
        """Send what is queued, as one message per wake-up (tokens of one step travel together)."""
        while True:
            batch = [self.out.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 4096:
                    batch.append(self.out.get_nowait())
            messages = _merge_tokens(batch)
            try:
                if messages:
                    self.conn.send(messages)
            except (OSError, EOFError, ValueError):  # the server is gone
                os._exit(0)
            except Exception as exc:  # noqa: BLE001 - an answer that does not pickle: say so instead
                log.exception("an answer could not be sent")
                for m in messages:
                    with contextlib.suppress(Exception):
                        self.conn.send([m])
                        continue
                    if isinstance(m, Done):
                        self.conn.send([Done(m.id, error=RuntimeError(f"answer not sendable: {exc!r}"))])


def _end_turn(turn: Session, finish: bool) -> Update | None:
    try:
        return turn.finish() if finish else None
    finally:
        turn.close()


class _Cancelled(Exception):
    pass


def _merge_tokens(messages: list[FromEngine]) -> list[FromEngine]:
    out: list[FromEngine] = []
    for m in messages:
        if isinstance(m, Tokens) and out and isinstance(out[-1], Tokens):
            out[-1].items.extend(m.items)
        else:
            out.append(m)
    return out


def _sendable(error: BaseException | None) -> BaseException | None:
    """The error itself when it pickles (its type and message reach the server), else a RuntimeError."""
    if error is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
