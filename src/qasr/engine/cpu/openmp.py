"""Keep the engine thread's OpenMP team fast: release idle OpenMP workers owned by other threads.

GNU OpenMP gives every thread that starts a parallel region its own pool of worker threads. Once the
pools hold more threads than there are CPUs, libgomp stops spin-waiting between parallel regions and
puts workers to sleep after ~100 spins, so each of the engine's thousands of small parallel regions
per second pays a futex wake-up: measured on 2 cores, a decode step went from 41 ms to 68 ms merely
because the main thread had loaded the model (and so owned an idle pool) before the engine thread
started. ``omp_pause_resource_all`` (OpenMP 5.0) frees the calling thread's idle pool; the engine
calls it from the threads that create it and submit to it. A thread that runs torch again simply gets
a new pool.
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
