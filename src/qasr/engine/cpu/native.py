"""The optional C++ kernels, built once per machine with torch's extension loader.

- decode attention: streams every cached key and value once per step; torch's GEMM kernels run the
  (2 query heads x context) shape far below memory bandwidth on CPUs, so a small loop does it instead.
- decoder ops: RMSNorm and q/k-norm + rotary in one pass each (a decode step is dispatch-bound there).
- bf16 linear: a batch-invariant AVX512-BF16 product (a row's result never depends on the other rows
  of the call, which oneDNN does not promise), also fast for the few-row decode products.
If no compiler is available the engine falls back to plain torch ops (same maths).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
CSRC = Path(__file__).with_name("csrc")


def decode_kernel() -> ModuleType | None:
    return _build("qasr_decode_attention", "decode_attention.cpp", fast_math=True)


def linear_kernel() -> ModuleType | None:
    """The bf16 linear module, or None when it cannot be built or this CPU lacks AVX512-BF16."""
    mod = _build("qasr_bf16_linear", "bf16_linear.cpp", fast_math=False)
    return mod if mod is not None and mod.supported() else None


def decoder_ops_kernel() -> ModuleType | None:
    """Fused bf16 RMSNorm and q/k-norm + rotary (engine/csrc/decoder_ops.cpp)."""
    return _build("qasr_decoder_ops", "decoder_ops.cpp", fast_math=False)


@functools.cache
def _build(name: str, source: str, fast_math: bool) -> ModuleType | None:
    if os.environ.get("QASR_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        flags = ["-O3", "-march=native", "-fopenmp"] + (["-ffast-math"] if fast_math else [])
        return load(name=name, sources=[str(CSRC / source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler, no headers: the torch path is correct, only slower
        log.warning("qasr: native kernel %s unavailable (%s); using the torch fallback", name, exc)
        return None


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip-installed one lives next to this interpreter."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*dirs, path]) if path else os.pathsep.join(dirs)
