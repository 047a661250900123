"""Building a native kernel with torch's extension loader, in a folder per environment and CPU (the build
key), under an OS file lock, a failed build remembered there; several at once with build_all. The folder, key,
lock and messages: docs/kernels.md. Progress goes to stderr by print: it must show without logging set up.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from qasr.engine.cpu.openmp import usable_cpus

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 300.0
LOCK_FILE = "qasr.lock"  # our flock; torch's marker file is "lock"
DONE_FILE = "built"
FAILED_FILE = "failed"  # a failed build's output: later loads fall back without compiling
# /proc/cpuinfo flags naming instruction sets -march=native may use (flags like "ht" do not change the code)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "popcnt", "abm", "movbe", "adx", "gfni",
                "vaes", "vpclmulqdq", "sha_ni", "aes", "pclmulqdq")
COMPILE_BYTES = 3 << 29  # a kernel compile's peak memory (torch's headers), with room
WAIT_NOTICE_S = 2.0  # longer than a cached load holds the lock
REBUILD_HINT = "`qasr kernels build` tries again"


@dataclass(frozen=True)
class KernelSpec:
    """One extension: its module name stem, C++ source, compiler flags and extra include folders."""

    name: str
    source: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    include: tuple[str, ...] = ()


def kernel_root() -> Path:
    """The folder holding every kernel build: $QASR_KERNEL_DIR, else the user's cache."""
    explicit = os.environ.get("QASR_KERNEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache_dir = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_dir) / "qasr" / "kernels"


@cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_flags() -> list[str]:
    """The CPU flags that go into the key (see ISA_PREFIXES), sorted."""
    return sorted(f for f in cpu_flags() if f.startswith(ISA_PREFIXES))


@cache
def compiler_identity() -> tuple[str, str]:
    """(the compiler command torch runs, the first line of its --version): a symlink makes the same code."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([*(shlex.split(cxx) or ["c++"]), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return cxx, out.splitlines()[0] if out else ""


def build_key(spec: KernelSpec) -> dict[str, object]:
    """Everything the built file depends on besides torch's headers (which torch's version and path pin)."""
    import torch

    content = hashlib.sha256(spec.source.read_bytes())
    for header in local_headers(spec):
        content.update(header.name.encode() + b"\0" + header.read_bytes())
    for folder in spec.include:
        for header in sorted(Path(folder).glob("*.h")):
            content.update(header.name.encode() + b"\0" + header.read_bytes())
    cxx, cxx_version = compiler_identity()
    return {
        "kernel": spec.name, "source_sha256": content.hexdigest(), "cflags": list(spec.cflags),
        "ldflags": list(spec.ldflags), "include": list(spec.include),
        "torch": torch.__version__, "torch_path": os.path.dirname(os.path.realpath(torch.__file__)),
        "python": sys.version, "prefix": os.path.realpath(sys.prefix),
        "compiler": cxx, "compiler_version": cxx_version,
        "machine": platform.machine(), "cpu_flags": isa_flags(),
    }


def local_headers(spec: KernelSpec) -> list[Path]:
    """Every header in the source's folder, sorted."""
    return sorted(spec.source.parent.glob("*.h"))


def kernel_dir(spec: KernelSpec) -> Path:
    """This environment's and this CPU's build folder for ``spec``."""
    return kernel_root() / module_name(spec)


def module_name(spec: KernelSpec) -> str:
    """The stem plus the key's digest: two keys used in one process never share torch's per-name version."""
    digest = hashlib.sha256(json.dumps(build_key(spec), sort_keys=True).encode()).hexdigest()
    return f"{spec.name}_{digest[:16]}"


def is_built(spec: KernelSpec) -> bool:
    """Whether ``spec`` was built here before."""
    return (kernel_dir(spec) / DONE_FILE).exists()


def failure_file(spec: KernelSpec) -> Path | None:
    """The output of ``spec``'s failed build here, or None."""
    marker = kernel_dir(spec) / FAILED_FILE
    return marker if marker.exists() else None


def wait_limit_s() -> float:
    """How long to wait for another process's build ($QASR_KERNEL_BUILD_WAIT_S, default 300)."""
    try:
        return max(0.0, float(os.environ.get("QASR_KERNEL_BUILD_WAIT_S", DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


def build(spec: KernelSpec, retry: bool = False) -> ModuleType | None:
    """The extension for ``spec``, built if this environment and CPU never built it; None with one warning
    where it cannot be built, its build failed before (unless ``retry``) or another process's outlasts the wait."""
    try:
        name = module_name(spec)
        folder = kernel_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        if not retry and (folder / FAILED_FILE).exists():
            return _failed_before(spec, folder)
        with _lock(folder, spec.name) as held:
            if not held:
                print(f"qasr: warning: gave up waiting {wait_limit_s():.0f} s for another process building the "
                      f"{spec.name} kernel in {folder}; using the torch fallback in this process (set "
                      "QASR_KERNEL_BUILD_WAIT_S to wait longer)", file=sys.stderr, flush=True)
                return None
            if retry:
                (folder / FAILED_FILE).unlink(missing_ok=True)
            elif (folder / FAILED_FILE).exists():  # the build we waited for failed
                return _failed_before(spec, folder)
            try:
                return _load(spec, name, folder)
            except Exception as exc:
                _record_failure(spec, folder, exc)
                return None
    except Exception as exc:  # a read-only cache, no torch headers: the torch path is correct, only slower
        log.warning("native kernel %s unavailable (%s); using the torch fallback", spec.name, exc)
        return None


def build_all(jobs: Iterable[Callable[[], object]], workers: int | None = None) -> None:
    """Run ``jobs`` (builds) on ``workers`` threads, default build_workers(); an interrupt fails none of them."""
    _stopping.clear()

    def run(job: Callable[[], object]) -> None:
        if not _stopping.is_set():  # no new compile once one saw the interrupt
            job()

    pool = ThreadPoolExecutor(max(1, workers or build_workers()), thread_name_prefix="qasr-build")
    try:
        for done in as_completed([pool.submit(run, job) for job in jobs]):
            done.result()
    except BaseException:
        _stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def build_workers() -> int:
    """Compiles to run at once: usable_cpus(), fewer where the available memory holds fewer compiles (one
    killed for memory would be recorded as failed)."""
    try:
        available = int(next(line.split()[1] for line in (_read("/proc/meminfo") or "").splitlines()
                             if line.startswith("MemAvailable:"))) * 1024
    except (StopIteration, ValueError, IndexError):
        return usable_cpus()
    return max(1, min(usable_cpus(), available // COMPILE_BYTES))


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


_stopping = threading.Event()  # an interrupt during build_all
_warned: set[str] = set()  # folders whose earlier failure this process has reported
_warned_lock = threading.Lock()


def _record_failure(spec: KernelSpec, folder: Path, exc: Exception) -> None:
    """Keep the build's output in its folder and warn once with its first errors (not for an interrupt)."""
    text = str(exc)
    if "interrupted by user" in text:  # ninja's word for a Ctrl-C
        _stopping.set()
    if _stopping.is_set():
        return
    marker = folder / FAILED_FILE
    try:
        marker.write_text(text + "\n")
        where = f"the compiler's output in {marker}"
    except OSError:
        where = "not recorded: the kernel folder is read-only"
    with _warned_lock:
        _warned.add(folder.name)
    log.warning("the %s kernel failed to build (%s; %s); using the torch fallback for it",
                spec.name, _errors(text), where)


def _failed_before(spec: KernelSpec, folder: Path) -> None:
    with _warned_lock:
        if folder.name in _warned:
            return None
        _warned.add(folder.name)
    log.warning("the %s kernel failed to build here before (see %s); using the torch fallback for it; %s",
                spec.name, folder / FAILED_FILE, REBUILD_HINT)
    return None


def _errors(output: str, most: int = 3) -> str:
    """The first error lines of a build's output (else its last lines), joined."""
    lines = [line.strip() for line in output.splitlines()
             if line.strip() and not line.startswith(("[", "FAILED:", "ninja:")) and " -o " not in line]
    errors = [line for line in lines if "error" in line.lower()] or lines[-most:]
    return " | ".join(errors[:most]) or "no output"


def _load(spec: KernelSpec, name: str, folder: Path) -> ModuleType:
    """torch's load() in ``folder``; we hold the folder's lock."""
    from torch.utils import cpp_extension

    # Nobody else can be building here now: a torch marker left by a killed build would block load() forever.
    (folder / "lock").unlink(missing_ok=True)
    fresh = not (folder / DONE_FILE).exists() or not (folder / f"{name}.so").exists()
    if fresh:
        _announce_first_build()
        (folder / "key.json").write_text(json.dumps(build_key(spec), indent=1) + "\n")
        # torch skips a build its table says this process made before, even one that failed
        getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(name, None)
    # Copies that change only with their bytes: ninja rebuilds on a newer mtime, which a git checkout gives.
    for original in (spec.source, *local_headers(spec)):
        _copy_if_changed(original, folder / original.name)
    source = folder / spec.source.name
    _put_ninja_on_path()
    start = time.monotonic()
    module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(spec.cflags),
                                extra_ldflags=list(spec.ldflags), extra_include_paths=list(spec.include),
                                build_directory=str(folder), verbose=False)
    if fresh:
        (folder / DONE_FILE).write_text(f"{time.monotonic() - start:.1f}\n")
        print(f"qasr: built the {spec.name} kernel in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    return module


def _copy_if_changed(original: Path, copy: Path) -> None:
    if not copy.exists() or copy.read_bytes() != original.read_bytes():
        tmp = copy.with_name(f"{copy.name}.{threading.get_ident()}.tmp")
        shutil.copyfile(original, tmp)
        os.replace(tmp, copy)


_announced = threading.Event()


def _announce_first_build() -> None:
    if not _announced.is_set():
        _announced.set()
        print(f"qasr: building qasr's CPU kernels for this machine (once per environment and CPU; in "
              f"{kernel_root()})...", file=sys.stderr, flush=True)


@contextmanager
def _lock(folder: Path, label: str) -> Iterator[bool]:
    """Hold ``folder``'s flock for the block (yields True), or yield False after waiting wait_limit_s()."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _acquire(fd, folder, label)
    finally:
        os.close(fd)


def _acquire(fd: int, folder: Path, label: str) -> bool:
    """flock ``fd``, polling (a blocking flock cannot time out), saying once that we wait."""
    limit = wait_limit_s()
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited >= limit:
                return False
            if not told and waited >= WAIT_NOTICE_S:
                print(f"qasr: waiting for another process building the {label} kernel in {folder} "
                      f"(up to {limit:.0f} s)...", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.1)


_path_lock = threading.Lock()


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip-installed one lives next to this interpreter."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    with _path_lock:
        path = os.environ.get("PATH", "")
        missing = [d for d in dirs if d not in path.split(os.pathsep)]
        if missing:
            os.environ["PATH"] = os.pathsep.join([*missing, path]) if path else os.pathsep.join(missing)
