"""Running ``qasr`` in a subprocess for the tests: its commands, and ``qasr serve`` on the demo model (not a test
module)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import websockets

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "models" / "qasr-demo-en"


# `python -m qasr ARGS` with SIGINT's default action restored in the child itself: a suite started in the
# background by a shell (`make test &`) passes SIGINT on ignored, and Python keeps an inherited "ignore". Not
# with preexec_fn: that makes subprocess fork() the whole test process, which fails with ENOMEM once the
# process maps many GB of (untouched) KV pools, where posix_spawn does not copy the address space at all.
QASR_WITH_SIGINT = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                    "sys.argv[0] = 'qasr'; runpy.run_module('qasr', run_name='__main__', alter_sys=True)")


def qasr_command(*args: str) -> list[str]:
    return [sys.executable, "-c", QASR_WITH_SIGINT, *args]


# qasr transcribe on the demo model, in float32 (the same text on every CPU), with no progress bar
DEMO_ARGS = ("-m", "models/qasr-demo-en", "--device", "cpu", "--dtype", "float32", "--no-progress")
ALARM = "examples/alarm.flac"


def run_qasr(*args: str) -> subprocess.CompletedProcess:
    """``qasr ARGS`` run to its end from the repository root, its output captured as text."""
    return subprocess.run(qasr_command(*args), capture_output=True, text=True, timeout=300, cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m qasr serve`` on a free port; ``health_seen`` records the /health statuses while starting."""

    def __init__(self, log_path: Path, *extra: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [sys.executable, "-m", "qasr", "serve", "-m", str(DEMO_MODEL), "--device", "cpu", "--dtype", "float32",
                "--port", str(self.port), *extra]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop(); a pipe could fill and block the server
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.health_seen: list[int] = []

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> ServerProcess:
        """Ready to serve (stopped again if it never gets there); ``with`` stops it at the end."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qasr serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
                self.health_seen.append(status)
                if status == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"qasr serve not ready after {timeout} s:\n{self.log()}")

    def engine_pid(self, timeout: float = 120) -> int:
        """The pid of the server's engine process (its child that multiprocessing's spawn_main runs), waiting up
        to ``timeout`` s for one to be running."""
        deadline = time.monotonic() + timeout
        while True:
            pids = []
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children():
                    with contextlib.suppress(psutil.Error):
                        if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                            pids.append(child.pid)
            if len(pids) == 1:
                return pids[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"not one engine process after {timeout} s: {pids}:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def gone(pid: int) -> bool:
    """No process ``pid`` runs (none, or a zombie left for a parent to reap)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text, or 0.0 when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name if not want else key == f"{name}{{{want}}}":
            return float(value)
    return 0.0


async def until_closed(ws: websockets.ClientConnection) -> tuple[list[dict], int | None]:
    """Every event up to the close, and the close code."""
    events = []
    with contextlib.suppress(websockets.ConnectionClosed):
        async for message in ws:
            events.append(json.loads(message))
    return events, ws.close_code
