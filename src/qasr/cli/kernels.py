"""``qasr kernels build``: build (several at once) and self-test every CPU kernel this machine can use ahead of
time, one report line each; ``qasr kernels where``: the builds' folder. torch loads only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

EXIT_OK, EXIT_FAILED = 0, 1
READY, FAILED, NOT_HERE = "ready", "failed", "not here"


def add_kernels_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    k = subparsers.add_parser(
        "kernels", help="build qasr's C++ CPU kernels for this machine now (else at first use)",
        description="qasr's C++ CPU kernels are built once per environment and CPU, at first use or by "
                    "`qasr kernels build`, in $QASR_KERNEL_DIR (default ~/.cache/qasr/kernels). A kernel this "
                    "CPU cannot run is reported and skipped; one that fails to build or self-test is reported "
                    "and the command exits 1. Either way the engine uses plain torch ops in its place "
                    "(docs/kernels.md).")
    action = k.add_subparsers(dest="kernels_action", required=True)
    action.add_parser("build", help="build and self-test every kernel this CPU can use (a build that failed before "
                                         "included); report each")
    action.add_parser("where", help="print the folder holding the builds")
    return k


@dataclass(frozen=True)
class _Entry:
    """One line of the report: a loader of native.py, the build it needs, the CPU flags it needs, and the
    kernels it stands in for (it is built only where none of them is ready, as the engine picks it)."""

    label: str
    loader: Callable[[], ModuleType | None]
    build: tuple[str, str, tuple[str, ...]]
    needs: frozenset[str]
    stands_in_for: tuple[str, ...] = ()


def kernels_command(args: argparse.Namespace) -> int:
    from qasr.engine.cpu import build

    if args.kernels_action == "where":
        print(build.kernel_root())
        return EXIT_OK
    try:
        return _build_all()
    except Exception as exc:  # the loaders catch build failures: anything here is a bug or a broken setup
        print(f"qasr: error: kernels build failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _entries() -> list[_Entry]:
    from qasr.engine.cpu import native

    return [
        _Entry("decode attention", native.decode_kernel, native.DECODE_ATTENTION, frozenset()),
        _Entry("encoder attention", native.encoder_attention_kernel, native.ENCODER_ATTENTION, frozenset()),
        _Entry("decoder ops", native.decoder_ops_kernel, native.DECODER_OPS, frozenset()),
        _Entry("encoder ops", native.encoder_ops_kernel, native.ENCODER_OPS, frozenset()),
        _Entry("AVX512-BF16 linear", native.avx512_kernel, native.BF16_LINEAR, native.AVX512_BF16_CPU),
        _Entry("AVX512-BF16 prefill attention", native.attention_kernel, native.PREFILL_ATTENTION,
               native.AVX512_BF16_CPU),
        _Entry("AMX-BF16 linear", native.amx_kernel, native.AMX_LINEAR, native.AMX_CPU),
        _Entry("AMX-INT8 linear", native.amx_int8_kernel, native.AMX_INT8, native.AMX_INT8_CPU),
        _Entry("AVX512-VNNI int8 linear", native.vnni_int8_kernel, native.INT8_VNNI, native.VNNI_CPU,
               ("AMX-INT8 linear",)),
        _Entry("AVX-VNNI int8 linear", native.avx_vnni_int8_kernel, native.AVX_VNNI, native.AVX_VNNI_CPU,
               ("AMX-INT8 linear", "AVX512-VNNI int8 linear")),
        _Entry("AVX512-VNNI int4 linear", native.int4_kernel, native.INT4_VNNI, native.VNNI_CPU),
    ]


def _build_all() -> int:
    from qasr.engine.cpu import build, native

    if os.environ.get("QASR_NO_NATIVE") == "1":
        print("QASR_NO_NATIVE=1: no kernels built; the engine uses plain torch ops")
        return EXIT_OK
    entries = [(entry, _not_here(entry, native.cpu_flags())) for entry in _entries()]
    possible = {entry.label for entry, reason in entries if reason is None}
    # at once: every kernel for this CPU but a stand-in for one that may be ready (built after, if it is not)
    first = [entry for entry, reason in entries if reason is None and not possible & set(entry.stands_in_for)]
    cached = {entry.build: build.is_built(native.spec(*entry.build)) for entry, _ in entries}
    start = time.monotonic()
    seconds = native.build_all([entry.build for entry in first], retry=True)
    ready, failed = [], []
    for entry, reason in entries:
        instead = [label for label in entry.stands_in_for if label in ready]
        if reason is None and instead:
            reason = f"not needed here ({instead[0]} runs instead); not built"
        elif reason is None:
            if entry not in first:
                seconds.update(native.build_all([entry.build], retry=True))
            loaded = time.monotonic()
            module = entry.loader()
            took = seconds.get(entry.build, 0.0) + time.monotonic() - loaded
            reason, status = _outcome(entry, module, cached[entry.build], took)
            {READY: ready, FAILED: failed}.get(status, []).append(entry.label)
        print(f"{entry.label}: {reason}")
    print(f"{len(ready)} kernels ready, {len(failed)} failed, in {time.monotonic() - start:.0f} s "
          f"({build.build_workers()} compiles at a time)")
    print(f"builds in {build.kernel_root()}")
    if failed:
        print(f"qasr: error: {len(failed)} kernel(s) for this CPU failed: {', '.join(failed)}; the engine uses "
              "plain torch ops for them (slower, same maths)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _not_here(entry: _Entry, cpu: frozenset[str]) -> str | None:
    """Why ``entry`` is not built on this CPU, or None."""
    missing = sorted(entry.needs - cpu)
    if missing:
        return f"not for this CPU (no {', '.join(missing)}); not built"
    if "amx_tile" in entry.needs and os.environ.get("QASR_NO_AMX") == "1":
        return "skipped (QASR_NO_AMX=1)"
    return None


def _outcome(entry: _Entry, module: ModuleType | None, cached: bool, took: float) -> tuple[str, str]:
    """(the report of a kernel built for this CPU, READY, FAILED or NOT_HERE)."""
    from qasr.engine.cpu import build, native

    if module is not None:
        if cached:
            return f"already built, self-test passed ({took:.1f} s)", READY
        return f"built and self-test passed ({took:.0f} s)", READY
    marker = build.failure_file(native.spec(*entry.build))
    if marker is not None:
        return f"failed to build (compiler output in {marker})", FAILED
    built = native.built_module(entry.build)
    if built is not None and hasattr(built, "supported") and not built.supported():
        return "not for this CPU (the CPU or OS refused its instructions)", NOT_HERE
    if built is not None:
        return "failed its self-test (see the warning above)", FAILED
    return "failed: unavailable (see the warning above)", FAILED
