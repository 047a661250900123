"""The optional C++ decode-attention kernel, built once per machine with torch's extension loader.

Decode attention streams every cached key and value once per step; torch's GEMM kernels run the
(2 query heads x context) shape far below memory bandwidth on CPUs, so a small hand-written loop
does it instead. If no compiler is available the engine falls back to plain torch ops (same maths).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"


@functools.cache
def decode_kernel() -> ModuleType | None:
    if os.environ.get("QASR_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        return load(name="qasr_decode_attention", sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers: the torch path is correct, only slower
        log.warning("qasr: native decode attention unavailable (%s); using the torch fallback", exc)
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
