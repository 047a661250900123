"""Free idle OpenMP worker pools of threads other than the engine's: once the pools outnumber the CPUs, GNU
OpenMP's workers sleep between regions and each small region pays a wake-up (docs/log/*-cpu-openmp-pools.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

log = logging.getLogger(__name__)
OMP_PAUSE_SOFT = 1


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
