"""Kernel builds in real processes: a build killed at any point never blocks a later one, two environments
and two CPUs keep their own builds, a process waiting on another's build gives up in bounded time, a failed
build is remembered (one short warning, no second compile) until `qasr kernels build` tries again, builds run
as many at once as the process has CPUs, and `qasr kernels build` / Ctrl-C behave. Every build goes to a
temporary QASR_KERNEL_DIR; the compiler is stalled or refused by a `c++` put first on PATH that passes
--version and -v through, so the build key (and folder) stays that of the real compiler.

The kernel built is tests/kernels/tiny_ext.cpp (plain CPython, compiled in about a second) through the real
path: native.spec (qasr's flags) and build.build (key, folder, flock, torch's stale lock, messages, wait,
give-up, failure marker), so nothing here waits on a real kernel's compile; the real kernels' self-tests have
their own tests (test_decoder_ops.py, test_selftest.py). `qasr kernels build` gets the tiny kernel in place of
decoder_ops (its self-test: add() adds)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from qasr.engine.cpu import build, native

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "models" / "qasr-demo-en"
TINY = Path(__file__).resolve().parents[2] / "kernels" / "tiny_ext.cpp"
TINY_SPEC = native.spec("qasr_tiny", str(TINY))  # an absolute source: CSRC / TINY is TINY
REAL_CXX = shutil.which(os.environ.get("CXX", "c++"))
BUILD_S = 300  # the tiny compile is ~1 s; the process around it imports torch (seconds, ~30 s under load)
pytestmark = pytest.mark.skipif(REAL_CXX is None or "CXX" in os.environ,
                                reason="needs the default `c++` compiler (the wrappers stand in for it)")
# one process's first use of the kernel: built (or loaded) by build.build, and it works
LOAD = ("from qasr.engine.cpu import build, native; "
        f"m = build.build(native.spec('qasr_tiny', {str(TINY)!r})); "
        "print('kernel', m is not None and m.add(2, 3) == 5)")
# flags no CPU of ours has (a future Xeon's), so "another CPU" differs from this one on every machine,
# an AMX Xeon included
OTHER_FLAGS = {"amx_fp8", "avx10_2"}
OTHER_CPU = (f"OTHER_FLAGS = {OTHER_FLAGS!r}; from qasr.engine.cpu import build; real = build.cpu_flags(); "
             "build.cpu_flags = lambda: real | OTHER_FLAGS; " + LOAD)
# `qasr kernels build` with the tiny kernel as decoder_ops (its loader, spec and self-test looked up at call time)
KERNELS_BUILD = f"""
import sys
from qasr.engine.cpu import native, selftest
from qasr.cli.main import main

def check(module):
    assert module.add(2, 3) == 5

native.DECODER_OPS = ('qasr_tiny', {str(TINY)!r}, ())
selftest.check_decoder_ops = check
sys.exit(main(['kernels', 'build']))
"""


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str
    seconds: float


def _env(kdir: Path, path_first: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QASR_NO_NATIVE", "QASR_KERNEL_BUILD_WAIT_S")}
    env["QASR_KERNEL_DIR"] = str(kdir)
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str], timeout: float) -> Run:
    start = time.monotonic()
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return Run(p.returncode, p.stdout, p.stderr, time.monotonic() - start)


def _compiler(folder: Path, body: str) -> Path:
    """A folder with a `c++` that runs ``body`` for a compile (-c) and is the real compiler otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "c++"
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-c" ] && {{ {body}; }}; done\nexec {REAL_CXX} "$@"\n')
    script.chmod(0o755)
    return folder


def _stalled(tmp: Path) -> tuple[Path, Path]:
    """(PATH folder of a compiler that stalls each compile, the file it touches when one starts). The stall
    lasts while a hold file exists, which ``_release_stalls`` removes once the test is done: killing the
    build's process group does not reach the compiler, which ninja starts in a group of its own."""
    mark, hold = tmp / "compiling", tmp / "stall-hold"
    hold.touch()
    _HOLDS.append(hold)
    return _compiler(tmp / "stall", f"touch {mark}; while [ -e {hold} ]; do sleep 0.2; done; exit 1"), mark


_HOLDS: list[Path] = []


def _release_stalls() -> None:
    while _HOLDS:
        _HOLDS.pop().unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _no_stalled_compiler_outlives_its_test():
    yield
    _release_stalls()


def _refusing(folder: Path) -> Path:
    """PATH folder of a compiler that refuses every compile at once (as on a machine where it cannot build)."""
    return _compiler(folder, "echo 'test compiler: refused' >&2; exit 1")


def _start_stalled(args: list[str], env: dict[str, str], mark: Path, err: Path) -> subprocess.Popen:
    """Start ``args`` in its own process group (a terminal's job) and return once its compile started."""
    with open(err, "w") as f:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not mark.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the build never reached the compiler (exit {proc.wait()}): {err.read_text()}")
        time.sleep(0.1)
    return proc


def _folder(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QASR_KERNEL_DIR", str(kdir))
    return build.kernel_dir(TINY_SPEC)


def _second_venv(where: Path) -> Path:
    """The python of a second virtual environment on the same torch (its site-packages adds this one's)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "qasr_main.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python


@dataclass(frozen=True)
class Scenario:
    kdir: Path
    folder: Path
    stale_torch_lock: bool  # the killed build left torch's marker file
    rebuilt: Run  # the next process, real compiler
    again: Run  # the one after
    python_b: Path  # a second environment's interpreter
    first_b: Run  # its first load, run while `rebuilt` ran


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """A first-run build SIGKILLed mid-compile (the whole job, as `timeout -s KILL` does), then two more
    runs with the real compiler in the same QASR_KERNEL_DIR (the folder of the tests below); a second
    environment's first load runs alongside the first of them (two builds at once, in two folders)."""
    tmp = tmp_path_factory.mktemp("kernels")
    kdir = tmp / "kernels"
    with pytest.MonkeyPatch.context() as mp:
        folder = _folder(kdir, mp)
    python_b = _second_venv(tmp / "venv-b")
    stall, mark = _stalled(tmp)
    proc = _start_stalled([sys.executable, "-c", LOAD], _env(kdir, stall), mark, tmp / "killed.err")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _release_stalls()
    stale = (folder / "lock").exists()
    start_b = time.monotonic()
    with subprocess.Popen([str(python_b), "-c", LOAD], env=_env(kdir), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT) as b:
        rebuilt = _run([sys.executable, "-c", LOAD], _env(kdir), BUILD_S)
        out_b, err_b = b.communicate(timeout=BUILD_S)
    first_b = Run(b.returncode, out_b, err_b, time.monotonic() - start_b)
    again = _run([sys.executable, "-c", LOAD], _env(kdir), 120)
    return Scenario(kdir, folder, stale, rebuilt, again, python_b, first_b)


def test_a_build_killed_mid_compile_does_not_block_the_next_process(scenario: Scenario) -> None:
    assert scenario.stale_torch_lock, "the killed build should have left torch's lock file (the old hang)"
    r = scenario.rebuilt
    assert r.code == 0 and "kernel True" in r.out, r.err  # built, loaded, and its function works
    assert "qasr: building qasr's CPU kernels for this machine" in r.err
    assert "qasr: built the qasr_tiny kernel in" in r.err
    assert not (scenario.folder / "lock").exists()
    assert (scenario.folder / build.DONE_FILE).exists()


def test_a_built_kernel_loads_without_building_or_messages(scenario: Scenario) -> None:
    r = scenario.again
    assert r.code == 0 and "kernel True" in r.out, r.err
    assert "building" not in r.err and "built" not in r.err and "waiting" not in r.err, r.err
    assert r.seconds < 60  # an import and a load


def test_two_environments_used_alternately_build_once_each(scenario: Scenario) -> None:
    """Environment B built its own kernel once (not A's folder, not A's build), alongside A's build; then
    A (the fixture's `again`), B, A each load their own build without compiling or relinking."""
    first_b = scenario.first_b
    assert first_b.code == 0 and "kernel True" in first_b.out, first_b.err
    assert "qasr: building" in first_b.err and "qasr: built the qasr_tiny kernel in" in first_b.err
    sos = {p: p.stat().st_mtime_ns for p in scenario.kdir.glob("qasr_tiny_*/*.so")}
    assert len(sos) == 2, sos
    assert "qasr: build" not in scenario.again.err, scenario.again.err  # A, after B built
    for python in (scenario.python_b, sys.executable):
        r = _run([str(python), "-c", LOAD], _env(scenario.kdir), 120)
        assert r.code == 0 and "kernel True" in r.out, r.err
        assert "building" not in r.err, f"{python} rebuilt its kernel: {r.err}"
    folders = sorted(p.parent.name for p in scenario.kdir.glob(f"qasr_tiny_*/{build.DONE_FILE}"))
    assert len(folders) == 2, folders
    assert {p: p.stat().st_mtime_ns for p in scenario.kdir.glob("qasr_tiny_*/*.so")} == sos  # neither relinked


def test_a_build_made_for_another_cpu_is_not_reused(scenario: Scenario, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Same environment, other CPU flags (a home directory moved to a machine with AVX-512 and AMX): the
    process starts its own build instead of loading this CPU's, which stays as it was."""
    so = next(scenario.folder.glob("*.so"))
    before = so.stat().st_mtime_ns
    stall, mark = _stalled(tmp_path)
    proc = _start_stalled([sys.executable, "-c", OTHER_CPU], _env(scenario.kdir, stall), mark, tmp_path / "err")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "qasr: building qasr's CPU kernels" in (tmp_path / "err").read_text()
    monkeypatch.setattr(build, "cpu_flags", lambda: native.cpu_flags() | OTHER_FLAGS)
    other = _folder(scenario.kdir, monkeypatch)
    assert other != scenario.folder and '"amx_fp8"' in (other / "key.json").read_text()
    assert so.stat().st_mtime_ns == before and not (scenario.folder / "lock").exists()


def test_a_process_waiting_on_another_build_says_so_and_gives_up_in_bounded_time(scenario: Scenario) -> None:
    fd = os.open(scenario.folder / build.LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a process in the middle of building it
        r = _run([sys.executable, "-c", LOAD], _env(scenario.kdir, QASR_KERNEL_BUILD_WAIT_S="3"), 120)
    finally:
        os.close(fd)
    assert r.code == 0 and "kernel False" in r.out, r.err  # the torch fallback
    assert r.err.count("qasr: waiting for another process building the qasr_tiny kernel") == 1, r.err
    assert "gave up waiting 3 s" in r.err and "torch fallback" in r.err


def test_a_waiting_process_goes_on_once_the_build_ends(scenario: Scenario, tmp_path: Path) -> None:
    fd = os.open(scenario.folder / build.LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    err_file = tmp_path / "err"
    try:
        with open(err_file, "w") as f, subprocess.Popen([sys.executable, "-c", LOAD], env=_env(scenario.kdir),
                                                         stdout=subprocess.PIPE, stderr=f, text=True,
                                                         cwd=ROOT) as proc:
            deadline = time.monotonic() + 120
            while "qasr: waiting" not in err_file.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
                time.sleep(0.1)
            time.sleep(1)  # waiting on past the notice (a second one would show), well inside the 300 s default
            os.close(fd)
            fd = -1
            out, _ = proc.communicate(timeout=120)
    finally:
        if fd >= 0:
            os.close(fd)
    err = err_file.read_text()
    assert proc.returncode == 0 and "kernel True" in out, err
    assert err.count("qasr: waiting for another process") == 1, err
    assert "qasr: building" not in err and "qasr: built" not in err, err  # it loaded the build it waited for


def test_a_header_beside_the_source_is_in_the_key_and_the_build(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied csrc folder: the tiny kernel including a header of its own folder with "..." (as the GEMM
    kernels include gemm_common.h). Editing the header changes the key (a new folder, a new build that
    sees the new header); rewriting it with the same bytes does not."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    source = TINY.read_text().replace("#include <Python.h>", '#include <Python.h>\n#include "tiny_offset.h"')
    (csrc / "tiny_ext.cpp").write_text(source.replace("a + b)", "a + b + TINY_OFFSET)"))
    header = csrc / "tiny_offset.h"
    header.write_text("#define TINY_OFFSET 0\n")
    spec = native.spec("qasr_tiny_header", str(csrc / "tiny_ext.cpp"))
    monkeypatch.setenv("QASR_KERNEL_DIR", str(tmp_path / "kernels"))
    first = build.kernel_dir(spec)
    mod = build.build(spec)
    assert mod is not None and mod.add(2, 3) == 5
    assert (first / "tiny_offset.h").read_text() == header.read_text()  # built from a copy beside the source's
    header.write_text("#define TINY_OFFSET 0\n")  # touched, same bytes (as a git checkout does)
    assert build.kernel_dir(spec) == first
    header.write_text("#define TINY_OFFSET 100\n")
    second = build.kernel_dir(spec)
    assert second != first
    mod = build.build(spec)
    assert mod is not None and mod.add(2, 3) == 105
    assert (first / build.DONE_FILE).exists() and (second / build.DONE_FILE).exists()


def test_kernels_build_reports_each_kernel_and_fails_on_a_failed_build(scenario: Scenario, tmp_path: Path) -> None:
    """The tiny kernel (as decoder_ops) is built already; every other compile is refused at once (as on a
    machine where it cannot build): each reported as failed, told apart from the kernels not for this CPU, and
    the command exits 1; the built one loads without a compile and passes its self-test."""
    r = _run([sys.executable, "-c", KERNELS_BUILD], _env(scenario.kdir, _refusing(tmp_path / "refuse")), 300)
    assert r.code == 1, r.out + r.err
    lines = dict(line.split(": ", 1) for line in r.out.splitlines() if ": " in line)
    assert lines["decoder ops"].startswith("already built, self-test passed"), r.out + r.err
    assert lines["decode attention"].startswith("failed to build (compiler output in "), r.out
    assert "test compiler: refused" in r.err
    assert r.err.count("qasr: warning: the qasr_decode_attention kernel failed") == 1, r.err
    for label, needs in (("AVX512-BF16 linear", native.AVX512_BF16_CPU), ("AMX-BF16 linear", native.AMX_CPU),
                         ("AVX512-VNNI int8 linear", native.VNNI_CPU), ("AMX-INT8 linear", native.AMX_INT8_CPU),
                         ("AVX-VNNI int8 linear", native.AVX_VNNI_CPU), ("AVX512-VNNI int4 linear", native.VNNI_CPU)):
        assert lines[label].startswith("not for this CPU" if not needs <= native.cpu_flags() else "failed to build")
    assert "qasr: error: " in r.err and "decode attention" in r.err.splitlines()[-1], r.err
    assert r.out.rstrip().endswith(f"builds in {scenario.kdir}")
    where = _run([sys.executable, "-m", "qasr", "kernels", "where"], _env(scenario.kdir), 60)
    assert where.code == 0 and where.out.strip() == str(scenario.kdir)
    # A later process, real compiler: the failure is remembered, not compiled again: one short warning
    load = ("from qasr.engine.cpu import native; print('kernel', native.decode_kernel() is not None); "
            "print('again', native._build(*native.DECODE_ATTENTION) is not None)")
    later = _run([sys.executable, "-c", load], _env(scenario.kdir), 120)
    assert later.code == 0 and "kernel False" in later.out and "again False" in later.out, later.err
    assert "building" not in later.err and "refused" not in later.err, later.err
    warning = [line for line in later.err.splitlines() if line.strip()]
    assert len(warning) == 1 and "qasr_decode_attention" in warning[0] and "qasr kernels build" in warning[0], \
        later.err


def test_a_failed_build_is_remembered_until_a_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("QASR_KERNEL_DIR", str(tmp_path / "kernels"))
    spec = native.spec("qasr_tiny_retry", str(TINY))
    folder = build.kernel_dir(spec)
    path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", f"{_refusing(tmp_path / 'refuse')}{os.pathsep}{path}")
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert build.build(spec) is None
    assert build.failure_file(spec) == folder / build.FAILED_FILE
    assert "test compiler: refused" in (folder / build.FAILED_FILE).read_text()
    assert "test compiler: refused" in caplog.text and "failed to build" in caplog.text
    monkeypatch.setenv("PATH", path)  # the real compiler again: still remembered
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert build.build(spec) is None
        assert build.build(spec) is None
    assert caplog.text.count("failed to build here before") <= 1  # this process reported it already
    assert not (folder / build.DONE_FILE).exists()
    mod = build.build(spec, retry=True)
    assert mod is not None and mod.add(2, 3) == 5
    assert build.failure_file(spec) is None and (folder / build.DONE_FILE).exists()


def test_build_all_runs_as_many_builds_at_once_as_it_has_workers() -> None:
    running, most, lock = [0], [0], threading.Lock()

    def job() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1

    build.build_all([job] * 6, workers=3)
    assert most[0] == 3
    most[0] = 0
    build.build_all([job] * 3, workers=1)
    assert most[0] == 1


def test_compiles_at_once_follow_the_usable_cpus_and_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPUs are openmp.usable_cpus' (affinity and cgroup quota, tested in test_usable_cpus.py)."""
    monkeypatch.setattr(build, "usable_cpus", lambda: 4)
    files: dict[str, str] = {}
    monkeypatch.setattr(build, "_read", files.get)
    files["/proc/meminfo"] = f"MemTotal: 8000000 kB\nMemAvailable: {build.COMPILE_BYTES * 3 // 1024 + 1} kB\n"
    assert build.build_workers() == 3  # as many compiles as the memory holds
    files["/proc/meminfo"] = "MemAvailable: 1000 kB\n"
    assert build.build_workers() == 1
    del files["/proc/meminfo"]
    assert build.build_workers() == 4


# `python -m qasr ARGS` with Ctrl-C at its default first: where this test runs with SIGINT ignored (a background
# job of a non-interactive shell, as some CI runners start it) the child would inherit SIG_IGN, which Python
# keeps, and no Ctrl-C would reach it. (A caught handler, unlike an ignored one, does not pass through exec.)
QASR_WITH_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                    "sys.argv = ['qasr', *sys.argv[1:]]; runpy.run_module('qasr', run_name='__main__', alter_sys=True)")


def _interrupted(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run ``args`` (``python -m qasr ...``) with a fresh kernel folder, Ctrl-C it (SIGINT to its job) while it
    compiles."""
    assert args[:3] == [sys.executable, "-m", "qasr"], args
    args = [sys.executable, "-c", QASR_WITH_CTRL_C, *args[3:]]
    stall, mark = _stalled(tmp_path)
    proc = _start_stalled(args, _env(tmp_path / "kernels", stall), mark, tmp_path / "err")
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stalled compiler, if it outlived the interrupt
        except ProcessLookupError:
            pass
    return code, (tmp_path / "err").read_text()


def _is_130(code: int) -> bool:
    """Exit status 130 as a shell reports it: 130, or death by SIGINT. Now and then (2 of ~30 tries, the
    interrupt landing inside `import torch`) CPython ends the process by SIGINT after our handler printed
    its line and returned 130 (its flag for an interrupt that escaped code it ran through PyRun_*, we
    believe); a shell shows that as 130 too."""
    return code in (130, -signal.SIGINT)


def test_ctrl_c_during_kernels_build_exits_130_with_one_line(tmp_path: Path) -> None:
    code, err = _interrupted([sys.executable, "-m", "qasr", "kernels", "build"], tmp_path)
    assert _is_130(code), err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "qasr: interrupted", err
    assert list((tmp_path / "kernels").glob(f"*/{build.FAILED_FILE}")) == []  # an interrupt is no failure


def test_ctrl_c_during_model_load_exits_130_with_one_line(tmp_path: Path) -> None:
    """transcribe's model load builds the decode-attention kernel (float32 or bf16, every CPU)."""
    import soundfile as sf

    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(16000, np.float32), 16000)
    code, err = _interrupted([sys.executable, "-m", "qasr", "transcribe", str(wav), "-m", str(DEMO),
                              "--device", "cpu"], tmp_path)
    assert _is_130(code), err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "qasr: interrupted", err


def _fake_kernels_build(monkeypatch: pytest.MonkeyPatch, vnni_int8: object | None) -> tuple[int, str, list]:
    """`qasr kernels build` on an AVX512-VNNI + AVX-VNNI CPU without AVX512-BF16 or AMX, every loader a fake
    that is ready but the AVX512-VNNI int8 one (``vnni_int8``); (exit status, report, builds asked for)."""
    from qasr.cli import kernels

    asked: list = []
    monkeypatch.setattr(native, "cpu_flags", lambda: native.VNNI_CPU | native.AVX_VNNI_CPU)
    monkeypatch.setattr(native, "build_all", lambda builds, retry=False: asked.append(list(builds)) or {})
    monkeypatch.setattr(build, "is_built", lambda spec: True)
    monkeypatch.setattr(build, "failure_file",
                        lambda spec: Path("/k/failed") if spec.name == "qasr_int8_vnni" else None)
    for loader in ("decode_kernel", "encoder_attention_kernel", "decoder_ops_kernel", "encoder_ops_kernel",
                   "avx_vnni_int8_kernel", "int4_kernel"):
        monkeypatch.setattr(native, loader, object)
    monkeypatch.setattr(native, "vnni_int8_kernel", lambda: vnni_int8)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = kernels._build_all()
    return code, out.getvalue(), asked


def test_kernels_build_leaves_out_a_stand_in_while_the_kernel_it_stands_in_for_is_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, asked = _fake_kernels_build(monkeypatch, vnni_int8=object())
    assert code == 0, out
    assert native.AVX_VNNI not in asked[0] and native.INT8_VNNI in asked[0] and len(asked) == 1
    assert "AVX-VNNI int8 linear: not needed here (AVX512-VNNI int8 linear runs instead); not built" in out
    assert "AVX512-BF16 linear: not for this CPU" in out and "AMX-INT8 linear: not for this CPU" in out


def test_kernels_build_builds_the_stand_in_when_the_kernel_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, asked = _fake_kernels_build(monkeypatch, vnni_int8=None)
    assert code == 1, out
    assert asked[1:] == [[native.AVX_VNNI]]
    assert "AVX512-VNNI int8 linear: failed to build (compiler output in /k/failed)" in out
    assert "AVX-VNNI int8 linear: already built, self-test passed" in out
    assert "1 failed" in out


def test_a_first_use_that_misses_a_kernel_builds_its_group_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The missing kernel and the others of its group this CPU can use, neither built nor failed before, each
    built once, together; a kernel outside every group, alone."""
    a, b, c, d = (("qasr_fake_" + x, x + ".cpp", ()) for x in "abcd")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(native, "FIRST_USE_GROUPS", (((a, frozenset()), (b, frozenset()), (c, native.AMX_CPU)),))
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(build, "usable_cpus", lambda: 3)
    monkeypatch.setattr(build, "is_built", lambda spec: False)
    monkeypatch.setattr(build, "failure_file", lambda spec: None)
    built, running, most, lock = [], [0], [0], threading.Lock()

    def fake_build(spec: build.KernelSpec, retry: bool = False) -> object:
        with lock:
            built.append(spec.name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return object()

    monkeypatch.setattr(build, "build", fake_build)
    assert native._build(*b) is not None
    assert sorted(built) == ["qasr_fake_a", "qasr_fake_b"] and most[0] == 2  # c needs AMX
    assert native._build(*a) is not None and len(built) == 2  # built with b
    assert native._build(*d) is not None and built[2:] == ["qasr_fake_d"]
