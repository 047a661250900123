"""A program that exits without closing its EngineProcess neither hangs nor leaves the engine process behind
(the engine process ignores SIGTERM, which is how multiprocessing ends daemon processes at exit)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.conftest import DEMO

PROGRAM = f"""
from qasr.engine.config import EngineConfig
from qasr.engine_process.child import EngineSpec
from qasr.engine_process.client import EngineProcess

process = EngineProcess(EngineSpec({str(DEMO)!r}, device="cpu", dtype="float32", warmup=False,
                                   engine=EngineConfig(kv_cache_bytes=16 * 2**20)))
process.start()
print(process.pid, flush=True)
"""
SLACK_S = 30.0  # a loaded 2-core machine: the start takes seconds, the exit must not take minutes


def test_an_exit_without_close_ends_the_engine_process() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60 + SLACK_S)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + SLACK_S
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine process outlived the program"
        time.sleep(0.05)
