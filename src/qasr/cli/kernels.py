"""``qasr kernels build`` and ``qasr kernels where``: build (and self-test) every CPU kernel this machine can
use ahead of time, so that a first transcription does not compile; show where the builds live.

Only argparse loads here at import time; torch loads when the command runs.
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


def add_kernels_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    k = subparsers.add_parser(
        "kernels", help="build qasr's C++ CPU kernels for this machine now (else at first use)",
        description="qasr's C++ CPU kernels are built once per environment and CPU, at first use or by "
                    "`qasr kernels build`, in $QASR_KERNEL_DIR (default ~/.cache/qasr/kernels). A kernel this "
                    "CPU cannot run is reported and skipped; the engine then uses plain torch ops (docs/kernels.md).")
    action = k.add_subparsers(dest="kernels_action", required=True)
    action.add_parser("build", help="build and self-test every kernel this CPU can use; report each")
    action.add_parser("where", help="print the folder holding the builds")
    return k


@dataclass(frozen=True)
class _Entry:
    """One line of the report: a loader of native.py, the build it needs, the CPU flags it needs."""

    label: str
    loader: Callable[[], ModuleType | None]
    build: tuple[str, str, tuple[str, ...]]
    needs: frozenset[str]


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
        _Entry("AVX512-VNNI int8 linear", native.vnni_int8_kernel, native.INT8_VNNI, native.VNNI_CPU),
        _Entry("AMX-INT8 linear", native.amx_int8_kernel, native.AMX_INT8, native.AMX_INT8_CPU),
        _Entry("AVX-VNNI int8 linear", native.avx_vnni_int8_kernel, native.AVX_VNNI, native.AVX_VNNI_CPU),
        _Entry("AVX512-VNNI int4 linear", native.int4_kernel, native.INT4_VNNI, native.VNNI_CPU),
    ]


def _build_all() -> int:
    from qasr.engine.cpu import build, native

    if os.environ.get("QASR_NO_NATIVE") == "1":
        print("QASR_NO_NATIVE=1: no kernels built; the engine uses plain torch ops")
        return EXIT_OK
    for entry in _entries():
        missing = sorted(entry.needs - native.cpu_flags())
        if missing:
            print(f"{entry.label}: not for this CPU (no {', '.join(missing)}); not built")
            continue
        if "amx_tile" in entry.needs and os.environ.get("QASR_NO_AMX") == "1":
            print(f"{entry.label}: skipped (QASR_NO_AMX=1)")
            continue
        cached = build.is_built(native.spec(*entry.build))
        start = time.monotonic()
        module = entry.loader()
        took = time.monotonic() - start
        if module is None:
            print(f"{entry.label}: unavailable (see the warning above); the engine uses plain torch ops for it")
        elif cached:
            print(f"{entry.label}: already built, self-test passed ({took:.1f} s)")
        else:
            print(f"{entry.label}: built and self-test passed ({took:.0f} s)")
    print(f"builds in {build.kernel_root()}")
    return EXIT_OK
