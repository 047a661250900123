"""Building one native kernel: in a folder that belongs to this environment and this CPU, under an OS file
lock that dies with its holder, telling the user when a first-run build starts and how long it took.

Why not torch's defaults: torch builds into ~/.cache/torch_extensions/<name>, whose build.ninja holds the
venv's own include paths (two environments on one machine rebuild each other's kernels, minutes each), which
is not keyed by the CPU while we compile with -march=native (a home directory moved to another CPU would load
instructions it cannot run), and whose lock is a marker file (a build killed at the wrong moment leaves it,
and every later load waits on it forever).

So each kernel is built in ``<root>/<name>_<key>/``, root = $QASR_KERNEL_DIR, else
${XDG_CACHE_HOME:-~/.cache}/qasr/kernels; the key hashes the kernel's source, the headers in its folder (and
in extra include folders), flags, torch's version and install path, the interpreter and sys.prefix, the
compiler and the CPU's instruction-set flags (key.json in the folder lists them). The build runs under
fcntl.flock on ``qasr.lock`` there: the OS releases it when its holder dies, however it dies, so a killed
build never blocks a later one. A process that finds another one building waits up to
$QASR_KERNEL_BUILD_WAIT_S (default 300) seconds, then uses the torch fallback for that kernel.

Progress goes to stderr with print, not logging: a silent minute at first use looks like a hang, and an
embedding program that never configured logging must see it too.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 300.0
LOCK_FILE = "qasr.lock"  # ours (flock); torch's own marker file in the same folder is "lock"
DONE_FILE = "built"  # written once a build loaded: its absence means the next load compiles
# the /proc/cpuinfo flags naming instruction sets -march=native may use: a CPU that differs in any of them
# gets its own build (flags like "ht" or "hypervisor" do not change the code and stay out of the key)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "popcnt", "abm", "movbe", "adx", "gfni",
                "vaes", "vpclmulqdq", "sha_ni", "aes", "pclmulqdq")
# a cached load holds the lock well under this (0.1-0.8 s here): only a real build makes a waiter say so
WAIT_NOTICE_S = 2.0


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
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "qasr" / "kernels"


@functools.cache
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


@functools.cache
def compiler_identity() -> tuple[str, str]:
    """(the compiler command torch will run, the first line of its --version). Not its path: a wrapper or
    a symlink of the same compiler makes the same code."""
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension runs
    try:
        out = subprocess.run([*(shlex.split(cxx) or ["c++"]), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""  # no compiler: the build itself will fail and say so
    return cxx, out.splitlines()[0] if out else ""


def build_key(spec: KernelSpec) -> dict[str, object]:
    """Everything the built file depends on besides torch's own headers' contents (which its version and
    path pin)."""
    import torch

    content = hashlib.sha256(spec.source.read_bytes())
    for header in local_headers(spec):  # csrc/*.h (e.g. gemm_common.h), copied beside the source to build
        content.update(header.name.encode() + b"\0" + header.read_bytes())
    for folder in spec.include:  # headers a test build adds (e.g. the AMX emulation)
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
    """The headers in the source's own folder (every one, whether this source includes it or not: a header
    that changes rebuilds every kernel of the folder, never too few), sorted."""
    return sorted(spec.source.parent.glob("*.h"))


def kernel_dir(spec: KernelSpec) -> Path:
    """This environment's and this CPU's build folder for ``spec``."""
    return kernel_root() / module_name(spec)


def module_name(spec: KernelSpec) -> str:
    """The extension's module name: the stem plus the key's digest, so two keys used in one process (tests)
    never meet in torch's per-name version table, which would rename the second build."""
    digest = hashlib.sha256(json.dumps(build_key(spec), sort_keys=True).encode()).hexdigest()
    return f"{spec.name}_{digest[:16]}"


def is_built(spec: KernelSpec) -> bool:
    """Whether ``spec`` was built and loaded here before (a later load compiles nothing)."""
    return (kernel_dir(spec) / DONE_FILE).exists()


def wait_limit_s() -> float:
    """How long to wait for another process's build ($QASR_KERNEL_BUILD_WAIT_S, default 300)."""
    try:
        return max(0.0, float(os.environ.get("QASR_KERNEL_BUILD_WAIT_S", DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


def build(spec: KernelSpec) -> ModuleType | None:
    """The extension for ``spec``, built here if this environment and CPU never built it; None (with one
    warning) when it cannot be built or another process's build outlasts the wait."""
    try:
        name = module_name(spec)
        folder = kernel_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        with _lock(folder, spec.name) as held:
            if not held:
                print(f"qasr: warning: gave up waiting {wait_limit_s():.0f} s for another process building the "
                      f"{spec.name} kernel in {folder}; using the torch fallback in this process (set "
                      "QASR_KERNEL_BUILD_WAIT_S to wait longer)", file=sys.stderr, flush=True)
                return None
            return _load(spec, name, folder)
    except Exception as exc:  # no compiler, no headers, a read-only cache: the torch path is correct, only slower
        log.warning("qasr: native kernel %s unavailable (%s); using the torch fallback", spec.name, exc)
        return None


def _load(spec: KernelSpec, name: str, folder: Path) -> ModuleType:
    """torch's load() in ``folder``; we hold the folder's lock."""
    from torch.utils.cpp_extension import load

    # Nobody else can be building here now: a torch marker left by a killed build would make load() wait
    # on it forever.
    (folder / "lock").unlink(missing_ok=True)
    fresh = not (folder / DONE_FILE).exists() or not (folder / f"{name}.so").exists()  # (or someone deleted it)
    if fresh:
        _announce_first_build()
        (folder / "key.json").write_text(json.dumps(build_key(spec), indent=1) + "\n")
    # Copies of the source and its folder's headers (found next to the copied source) that never change:
    # ninja rebuilds when a source's or header's mtime is newer than its object, and a git checkout touches
    # files without changing them.
    for original in (spec.source, *local_headers(spec)):
        _copy_if_changed(original, folder / original.name)
    source = folder / spec.source.name
    _put_ninja_on_path()
    start = time.monotonic()
    module = load(name=name, sources=[str(source)], extra_cflags=list(spec.cflags),
                  extra_ldflags=list(spec.ldflags), extra_include_paths=list(spec.include),
                  build_directory=str(folder), verbose=False)
    if fresh:
        (folder / DONE_FILE).write_text(f"{time.monotonic() - start:.1f}\n")
        print(f"qasr: built the {spec.name} kernel in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    return module


def _copy_if_changed(original: Path, copy: Path) -> None:
    """``copy`` holds ``original``'s bytes, written (atomically) only if it did not already."""
    if not copy.exists() or copy.read_bytes() != original.read_bytes():
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.copyfile(original, tmp)
        os.replace(tmp, copy)


@functools.cache
def _announce_first_build() -> None:
    """Once per process, before its first compile."""
    print(f"qasr: building qasr's CPU kernels for this machine (about a minute each, once; in {kernel_root()})...",
          file=sys.stderr, flush=True)


@contextmanager
def _lock(folder: Path, label: str) -> Iterator[bool]:
    """Hold ``folder``'s flock for the block (yields True), or yield False after waiting wait_limit_s().
    The OS releases it when the descriptor closes, including when the process is killed."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _acquire(fd, folder, label)
    finally:
        os.close(fd)  # releases the flock


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


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip-installed one lives next to this interpreter."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "")
    missing = [d for d in dirs if d not in path.split(os.pathsep)]  # not once more per kernel
    if missing:
        os.environ["PATH"] = os.pathsep.join([*missing, path]) if path else os.pathsep.join(missing)
