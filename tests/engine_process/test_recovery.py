"""An engine process that dies or stops stepping is replaced: the calls in flight (requests, a live turn) fail at
once with EngineBroken, the engine is not ready until a new process has loaded the model and warmed up (stepped),
``restarts`` counts it, and the same pieces give the same tokens after. The deaths: SIGKILL, and faults injected
into the engine process by faults/sitecustomize.py (on PYTHONPATH, inherited by the spawned process): a step that
raises (the engine reports itself broken), one that never returns (stalled past ``timeout_s``), and one that never
returns holding the GIL (the engine process sends nothing past ``timeout_s``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest

from qasr.engine.config import EngineConfig
from qasr.engine.engine import RequestSpec
from qasr.engine.errors import EngineBroken
from qasr.engine_process import client
from qasr.engine_process.child import STATS_EVERY_S, EngineSpec
from qasr.engine_process.client import EngineProcess, RemoteEngine
from qasr.engine_process.shared_array import SharedArray
from qasr.model.checkpoint import load_checkpoint
from qasr.streaming import StreamConfig
from tests.conftest import DEMO, prompt_for

FAULTS = Path(__file__).resolve().parent / "faults"
TIMEOUT_S = 3.0  # the engine processes' timeout_s in the hang tests
SLACK_S = 15.0  # what a loaded 2-core machine may add to a deadline
SPEC = EngineSpec(str(DEMO), device="cpu", dtype="float32", engine=EngineConfig(kv_cache_bytes=64 * 2**20))


@pytest.fixture(scope="module")
def checkpoint():  # noqa: ANN201 - a Checkpoint without weights: prompts and features
    return load_checkpoint(DEMO, weights=False)


def started(timeout_s: float = 60.0) -> tuple[EngineProcess, RemoteEngine]:
    process = EngineProcess(SPEC, timeout_s)
    process.start()
    engine = RemoteEngine(process, "asr", load_checkpoint(DEMO, weights=False).features)
    assert process.ready and not engine.stats().broken
    assert engine.stats().steps > 0, "ready before its warm-up"
    return process, engine


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, EngineProcess, RemoteEngine]]:
    """An engine process with faults/sitecustomize.py loaded (``timeout_s`` TIMEOUT_S); write the fault file to
    make its next step fail."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("QASR_TEST_FAULT", str(fault))
    process, engine = started(TIMEOUT_S)
    try:
        yield fault, process, engine
    finally:
        process.close()


def long_request(ck, wave: np.ndarray) -> RequestSpec:  # noqa: ANN001
    """Busy for far longer than any test waits (forced tokens)."""
    return RequestSpec(prompt_for(ck, wave), 4000, waveform=wave, ignore_eos=True)


def tokens_of(engine: RemoteEngine, ck, clips: list[np.ndarray]) -> list[list[int]]:  # noqa: ANN001
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 48, waveform=w)) for w in clips]
    return [f.result(120).token_ids for f in futures]


def in_flight(engine: RemoteEngine, ck, clips: list[np.ndarray]) -> tuple[list[Future], list[list]]:  # noqa: ANN001
    """Two long requests under way (each has streamed a token) and their streamed tokens."""
    streams: list[list] = [[], []]
    going = [threading.Event(), threading.Event()]

    def listener(k: int):  # noqa: ANN202
        def on_token(token: int | None) -> None:
            streams[k].append(token)
            going[k].set()
        return on_token

    futures = [engine.submit(long_request(ck, clips[k]), on_token=listener(k)) for k in range(2)]
    assert all(g.wait(60) for g in going), "the requests never started"
    return futures, streams


def assert_fail_fast(futures: list[Future], since: float, within: float) -> float:
    """Each future fails with EngineBroken within ``within`` s of ``since``; returns when the last failed."""
    for f in futures:
        with pytest.raises(EngineBroken):
            f.result(timeout=max(0.1, since + within - time.monotonic()))
    return time.monotonic() - since


def assert_restarted(process: EngineProcess, engine: RemoteEngine, old_pid: int) -> None:
    """Soon not ready (refusing calls, stats marked broken) until a new engine process is; then ready, the
    restart counted once, the old process gone."""
    deadline = time.monotonic() + SLACK_S
    while process.ready:
        assert time.monotonic() < deadline, "the engine process was not given up on"
        time.sleep(0.01)
    assert engine.stats().broken
    shared: list[SharedArray] = []
    real_share = client.share

    def recording_share(array):  # noqa: ANN001, ANN202
        sent = real_share(array)
        shared.append(sent)
        return sent

    client.share = recording_share
    try:
        with pytest.raises(EngineBroken):  # 10 s: its features would go by shared memory
            engine.submit(RequestSpec([1, 2, 3], 1, waveform=np.zeros(160000, np.float32)))
    finally:
        client.share = real_share
    assert len(shared) == 1 and isinstance(shared[0], SharedArray)
    assert not Path("/dev/shm", shared[0].name.lstrip("/")).exists(), "a refused call's block was left behind"
    deadline = time.monotonic() + 120
    while not process.ready:
        assert time.monotonic() < deadline, "no new engine process within 120 s"
        time.sleep(0.05)
    assert not engine.stats().broken, "ready before its first stats snapshot"
    assert engine.stats().steps > 0, "a new engine process served before its warm-up"
    assert process.restarts == 1
    assert process.pid is not None and process.pid != old_pid
    assert not psutil.pid_exists(old_pid), "the old engine process is left behind"


def test_sigkill_with_calls_in_flight(checkpoint, demo_clips) -> None:  # noqa: ANN001
    process, engine = started()
    try:
        before = tokens_of(engine, checkpoint, demo_clips)
        futures, streams = in_flight(engine, checkpoint, demo_clips)
        turns = [engine.open_turn(StreamConfig(chunk_size_sec=1.0)) for _ in range(2)]
        for turn in turns:
            assert len(turn.push(demo_clips[0][:16000])) == 1
        old_pid = process.pid
        assert old_pid is not None
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        assert assert_fail_fast(futures, killed, 10.0) < 10.0
        assert all(s[-1] is None for s in streams), "a streamed call did not end its stream"
        with pytest.raises(EngineBroken):
            turns[0].push(demo_clips[0][16000:32000])  # its engine process is gone: so is the turn
        turns[0].close()
        assert_restarted(process, engine, old_pid)
        assert tokens_of(engine, checkpoint, demo_clips) == before
        with pytest.raises(EngineBroken, match="live turn ended"):  # not a turn of the new engine process
            turns[1].push(demo_clips[0][16000:32000])
        turns[1].close()
        turn = engine.open_turn(StreamConfig(chunk_size_sec=1.0))
        assert len(turn.push(demo_clips[0][:16000])) == 1
        turn.close()
        deadline = time.monotonic() + SLACK_S
        while process._pending:  # every call answered, the last close's included
            assert time.monotonic() < deadline, process._pending
            time.sleep(0.02)
    finally:
        process.close()
    assert not process.ready


@pytest.mark.slow  # about 15 s each; test_sigkill_with_calls_in_flight is the default suite's
@pytest.mark.parametrize("fault", ["raise", "sleep", "gil"])
def test_a_step_that_fails_or_never_returns(faulty, checkpoint, demo_clips, fault: str) -> None:  # noqa: ANN001
    path, process, engine = faulty
    before = tokens_of(engine, checkpoint, demo_clips)
    old_pid = process.pid
    assert old_pid is not None
    path.write_text(fault)
    at = time.monotonic()
    futures = [engine.submit(long_request(checkpoint, w)) for w in demo_clips[:2]]
    if fault == "gil":  # the engine process reads no pipe now; a caller (the event loop) still never waits on it
        while path.exists():
            assert time.monotonic() - at < SLACK_S, "the fault never ran"
            time.sleep(0.01)
        for wave in demo_clips * 2:  # each over 64 KiB of features in the message: more than the pipe holds
            sent = time.monotonic()
            futures.append(engine.submit(RequestSpec(prompt_for(checkpoint, wave), 8, waveform=wave)))
            assert time.monotonic() - sent < 1.0, "a submit waited on the engine process's pipe"
    took = assert_fail_fast(futures, at, TIMEOUT_S + SLACK_S)
    assert not path.exists(), "the fault never ran"
    if fault != "raise":  # a hang is given up on after timeout_s (from its last stats snapshot), not before
        assert took >= TIMEOUT_S - STATS_EVERY_S - 0.1
    assert_restarted(process, engine, old_pid)
    assert tokens_of(engine, checkpoint, demo_clips) == before


@pytest.mark.slow
def test_close_while_a_new_engine_process_loads(checkpoint, demo_clips, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """close() during a restart returns at once, fails what was in flight, and leaves no engine process."""
    process, engine = started()
    futures, _ = in_flight(engine, checkpoint, demo_clips)
    old_pid = process.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    assert_fail_fast(futures, time.monotonic(), 10.0)
    deadline = time.monotonic() + SLACK_S
    while not [pid for pid in engine_processes() if pid != old_pid]:  # the new one is loading
        assert time.monotonic() < deadline, "no new engine process"
        time.sleep(0.01)
    assert not process.ready
    at = time.monotonic()
    process.close()
    assert time.monotonic() - at < 1.0
    assert not engine_processes(), "an engine process was left running"
    assert "trying again" not in caplog.text


def engine_processes() -> list[int]:
    """This process's children that run an engine process (live, not zombies)."""
    pids = []
    for c in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                pids.append(c.pid)
    return pids


def start_within(process: EngineProcess, timeout: float = 60.0) -> None:
    """``process.start()``, failing the test rather than hanging it."""
    started_: Future = Future()

    def start() -> None:
        try:
            started_.set_result(process.start())
        except BaseException as exc:  # noqa: BLE001 - the test's to see
            started_.set_exception(exc)

    threading.Thread(target=start, daemon=True).start()
    started_.result(timeout)


def test_an_engine_process_that_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """start() raises when the model does not load, or when no process can be started at all."""
    missing = EngineProcess(replace(SPEC, model=str(tmp_path / "no-such-model")), 60)
    with pytest.raises(RuntimeError, match="the engine process failed to start: "):
        start_within(missing)
    assert not missing.ready and missing.restarts == 0

    def cannot_spawn(self: EngineProcess) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(EngineProcess, "_spawn", cannot_spawn)
    with pytest.raises(RuntimeError, match="could not be started"):
        start_within(EngineProcess(SPEC, 60))
