"""The engine's OpenMP threads: how many the host allows (``usable_cpus``), and freeing idle worker pools of
other threads: once the pools outnumber the CPUs, GNU OpenMP's workers sleep between regions and each small
region pays a wake-up (docs/log/*-cpu-openmp-pools.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)
OMP_PAUSE_SOFT = 1
CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, membership: str | None = None) -> int:
    """The CPUs this process can keep busy: its affinity, capped by its cgroups' CPU quota rounded down; at
    least 1. ``membership``: /proc/self/cgroup's text (read when None)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_quota(root, membership)
    return max(1, cpus if quota is None else min(cpus, int(quota)))


def cpu_quota(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """CPUs' worth of time the tightest cgroup on the way from this process's own to the root allows (v2
    cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us); None where none is set."""
    if membership is None:
        membership = _read(Path("/proc/self/cgroup")) or ""
    quotas = []
    for line in membership.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v1 = "cpu" in controllers.split(",")
        if not v1 and controllers:
            continue
        base = root / "cpu" if v1 else root
        # from the process's own cgroup up to the base (a container's own cgroup: the folders below may be missing)
        folder = base / path.strip("/")
        while True:
            quotas.append(_quota(folder, v1))
            if folder == base:
                break
            folder = folder.parent
    return min((q for q in quotas if q is not None), default=None)


def _quota(folder: Path, v1: bool) -> float | None:
    if v1:
        text = f"{_read(folder / 'cpu.cfs_quota_us')} {_read(folder / 'cpu.cfs_period_us')}"
    else:
        text = _read(folder / "cpu.max") or ""  # "QUOTA PERIOD" or "max PERIOD"
    try:
        quota, period = (int(word) for word in text.split())
    except ValueError:  # unlimited, or no such file
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                return lib
    except OSError as exc:
        log.debug("qasr: no OpenMP runtime handle (%s)", exc)
    return None


def release_idle_workers() -> None:
    """Free the calling thread's idle OpenMP worker pool (no-op where the runtime has none)."""
    lib = _runtime()
    if lib is not None:
        lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
