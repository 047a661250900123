"""The optional C++ kernels of csrc/ (what each does and why: docs/engine.md; which runs on which CPU:
docs/kernels.md), built by build.py, each proved by its self-test (selftest.py) before use. A loader gives None
where its kernel cannot be built, does not suit the CPU or fails its self-test; the engine then takes the next
kernel or plain torch ops. QASR_NO_NATIVE=1 turns every kernel off, QASR_NO_AMX=1 the AMX ones.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from types import ModuleType

from qasr.engine.cpu import build, selftest
from qasr.engine.cpu.build import cpu_flags

log = logging.getLogger(__name__)
CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp")
# -march=native enables AMX with recent compilers; naming it serves older ones
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
# (module name, source, flags) of each build; `qasr kernels build` builds the same ones
DECODE_ATTENTION = ("qasr_decode_attention", "decode_attention.cpp", ("-ffast-math",))
ENCODER_ATTENTION = ("qasr_encoder_attention", "encoder_attention.cpp", ("-ffast-math",))
DECODER_OPS = ("qasr_decoder_ops", "decoder_ops.cpp", ())
ENCODER_OPS = ("qasr_encoder_ops", "encoder_ops.cpp", ())
AMX_LINEAR = ("qasr_amx_linear", "amx_linear.cpp", AMX_FLAGS)
BF16_LINEAR = ("qasr_bf16_linear", "bf16_linear.cpp", ())
PREFILL_ATTENTION = ("qasr_prefill_attention", "prefill_attention.cpp", ())
# The int8 epilogue is specified without fused multiply-add: GCC contracts even intrinsics' mul + add otherwise.
NO_FMA = ("-ffp-contract=off",)
INT8_VNNI = ("qasr_int8_vnni", "int8_linear.cpp", NO_FMA)
INT4_VNNI = ("qasr_int4_vnni", "int4_linear.cpp", NO_FMA)
AMX_INT8 = ("qasr_amx_int8", "amx_int8.cpp", (*NO_FMA, "-mamx-tile", "-mamx-int8"))
# without AVX-512 even where the CPU has it: the kernel is for CPUs that lack it
AVX_VNNI = ("qasr_int8_avx_vnni", "int8_avx_vnni.cpp", (*NO_FMA, "-mno-avx512f", "-mavxvnni"))
# the CPU flags without which a kernel is not even built (it would compile to supported() == False)
AMX_CPU = frozenset({"amx_bf16", "amx_tile"})
AVX512_BF16_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
VNNI_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AMX_INT8_CPU = frozenset({"amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512vl"})  # AVX-512: quantize, epilogue
AVX_VNNI_CPU = frozenset({"avx2", "avx_vnni"})
# (build, CPU flags it needs): a first use that misses one builds the others of its group with it, at once
FIRST_USE_GROUPS = (
    ((DECODE_ATTENTION, frozenset()), (ENCODER_ATTENTION, frozenset()), (DECODER_OPS, frozenset()),
     (ENCODER_OPS, frozenset()), (BF16_LINEAR, AVX512_BF16_CPU), (PREFILL_ATTENTION, AVX512_BF16_CPU),
     (AMX_LINEAR, AMX_CPU)),
    ((AMX_INT8, AMX_INT8_CPU), (INT8_VNNI, VNNI_CPU), (INT4_VNNI, VNNI_CPU)),
)


@functools.cache
def decode_kernel() -> ModuleType | None:
    """Batched single-token attention over the KV pool (decode_attention.cpp)."""
    mod = _build(*DECODE_ATTENTION)
    return selftest.verified("decode attention", mod, selftest.check_decode_attention)


@functools.cache
def encoder_attention_kernel() -> ModuleType | None:
    """The audio encoder's windowed attention (encoder_attention.cpp)."""
    mod = _build(*ENCODER_ATTENTION)
    return selftest.verified("encoder attention", mod, selftest.check_encoder_attention)


@functools.cache
def decoder_ops_kernel() -> ModuleType | None:
    """Fused RMSNorm, q/k-norm + rotary, SiLU * up (decoder_ops.cpp)."""
    mod = _build(*DECODER_OPS)
    return selftest.verified("decoder ops", mod, selftest.check_decoder_ops)


@functools.cache
def encoder_ops_kernel() -> ModuleType | None:
    """The encoder's first convolution, GELU + padding between its convolutions (encoder_ops.cpp)."""
    mod = _build(*ENCODER_OPS)
    return selftest.verified("encoder ops", mod, selftest.check_encoder_ops)


@functools.cache
def linear_kernel() -> ModuleType | None:
    """The batch-invariant bf16 GEMM module (pack, linear, conv): AMX, else AVX512-BF16, else None."""
    amx = amx_kernel()
    return amx if amx is not None else avx512_kernel()


@functools.cache
def amx_kernel() -> ModuleType | None:
    """The AMX-BF16 GEMM module (amx_linear.cpp), or None (also where QASR_NO_AMX=1 or the OS refuses AMX)."""
    if os.environ.get("QASR_NO_AMX") == "1" or not AMX_CPU <= cpu_flags():
        return None  # not built at all: -march=native would compile it to supported() == False anyway
    mod = _build(*AMX_LINEAR)
    if mod is None:
        return None
    if not mod.supported():
        log.warning("qasr: the AMX kernel cannot run here (the CPU or OS refused AMX tile data); using AVX512-BF16")
        return None
    return selftest.verified("AMX-BF16 linear", mod, selftest.check_gemm)


@functools.cache
def avx512_kernel() -> ModuleType | None:
    """The AVX512-BF16 GEMM module (bf16_linear.cpp)."""
    return selftest.verified("AVX512-BF16 linear", _bf16_module(), selftest.check_gemm)


@functools.cache
def attention_kernel() -> ModuleType | None:
    """The flash-style bf16 prefill attention (prefill_attention.cpp)."""
    return selftest.verified("AVX512-BF16 prefill attention", _bf16_module(PREFILL_ATTENTION),
                             selftest.check_prefill_attention)


@functools.cache
def int8_kernel() -> ModuleType | None:
    """The fastest exact int8 W8A8 GEMM module that passed its self-test here (pack, quantize_rows, linear):
    the AMX-INT8 one, else the AVX512-VNNI one, else the AVX-VNNI (256-bit) one, else None. Each is built
    only when the ones before it are unavailable."""
    for loader in (amx_int8_kernel, vnni_int8_kernel, avx_vnni_int8_kernel):
        mod = loader()
        if mod is not None:
            return mod
    return None


@functools.cache
def amx_int8_kernel() -> ModuleType | None:
    """The AMX-INT8 GEMM module (amx_int8.cpp), or None (also where QASR_NO_AMX=1 or the OS refuses AMX)."""
    if os.environ.get("QASR_NO_AMX") == "1" or not AMX_INT8_CPU <= cpu_flags():
        return None
    mod = _build(*AMX_INT8)
    if mod is None:
        return None
    if not mod.supported():
        log.warning("qasr: the AMX-INT8 kernel cannot run here (the CPU or OS refused AMX tile data); "
                    "using AVX512-VNNI")
        return None
    return selftest.verified("AMX-INT8 linear", mod, selftest.check_int8_gemm)


@functools.cache
def vnni_int8_kernel() -> ModuleType | None:
    """The AVX512-VNNI int8 GEMM module (int8_linear.cpp)."""
    return _int8_module(VNNI_CPU, INT8_VNNI, "AVX512-VNNI int8 linear")


@functools.cache
def avx_vnni_int8_kernel() -> ModuleType | None:
    """The 256-bit AVX-VNNI int8 GEMM module (int8_avx_vnni.cpp), for CPUs without AVX-512."""
    return _int8_module(AVX_VNNI_CPU, AVX_VNNI, "AVX-VNNI int8 linear")


@functools.cache
def int4_kernel() -> ModuleType | None:
    """The AVX512-VNNI int4 W4A8 GEMM module (int4_linear.cpp: pack(w_q, w_scale), linear)."""
    if not VNNI_CPU <= cpu_flags():
        return None
    mod = _build(*INT4_VNNI)
    if mod is None or not mod.supported():
        return None
    return selftest.verified("AVX512-VNNI int4 linear", mod, selftest.check_int4_gemm)


def _int8_module(needs: frozenset[str], build_spec: tuple, name: str) -> ModuleType | None:
    """The int8 module of ``build_spec``, built only where the CPU has the flags it ``needs``."""
    if not needs <= cpu_flags():
        return None
    mod = _build(*build_spec)
    if mod is None or not mod.supported():
        return None
    return selftest.verified(name, mod, selftest.check_int8_gemm)


def clear_caches() -> None:
    """Forget which kernels were chosen and verified (tests); built modules stay loaded."""
    for fn in (decode_kernel, decoder_ops_kernel, encoder_ops_kernel, linear_kernel, amx_kernel, avx512_kernel,
               attention_kernel, int8_kernel, amx_int8_kernel, vnni_int8_kernel, avx_vnni_int8_kernel, int4_kernel,
               _bf16_module, cpu_flags):
        getattr(fn, "cache_clear", lambda: None)()  # a test may have replaced one by a plain function


@functools.cache
def _bf16_module(build_spec: tuple = BF16_LINEAR) -> ModuleType | None:
    if not AVX512_BF16_CPU <= cpu_flags():
        return None  # not even built, as the AMX one
    mod = _build(*build_spec)
    return mod if mod is not None and mod.supported() else None


def _build(name: str, source: str, flags: tuple[str, ...] = (), include: tuple[str, ...] = ()) -> ModuleType | None:
    """The extension built from csrc/``source`` with the base flags plus ``flags``, or None."""
    if os.environ.get("QASR_NO_NATIVE") == "1":
        return None
    return _compile(name, source, flags, include)


def spec(name: str, source: str, flags: tuple[str, ...] = (), include: tuple[str, ...] = ()) -> build.KernelSpec:
    """The build of csrc/``source`` with the base flags plus ``flags``."""
    return build.KernelSpec(name, CSRC / source, (*BASE_FLAGS, *flags), ("-fopenmp",), include)


def build_all(builds: list[tuple], retry: bool = False) -> dict[tuple, float]:
    """Build each of ``builds`` (the tuples above), as many at once as this process has CPUs, for the loaders
    to find; ``retry`` tries a build that failed before again. Each build's seconds."""
    if os.environ.get("QASR_NO_NATIVE") == "1":
        return {}
    seconds: dict[tuple, float] = {}

    def job(build_spec: tuple) -> None:
        start = time.monotonic()
        key = _key(*build_spec)
        _modules[key] = build.build(spec(*key), retry=retry)
        seconds[build_spec] = time.monotonic() - start

    build.build_all([functools.partial(job, b) for b in dict.fromkeys(builds)])
    return seconds


def built_module(build_spec: tuple) -> ModuleType | None:
    """The module this process built for ``build_spec`` (before any self-test), or None."""
    return _modules.get(_key(*build_spec))


_modules: dict[tuple, ModuleType | None] = {}  # every build of this process, by _key


def _key(name: str, source: str, flags: tuple[str, ...] = (), include: tuple[str, ...] = ()) -> tuple:
    return name, source, tuple(flags), tuple(include)


def _compile(name: str, source: str, flags: tuple[str, ...], include: tuple[str, ...]) -> ModuleType | None:
    key = _key(name, source, flags, include)
    if key not in _modules:
        group = _missing_with(key)
        if len(group) > 1:
            build_all(group)
    if key not in _modules:
        _modules[key] = build.build(spec(*key))
    return _modules[key]


def _missing_with(key: tuple) -> list[tuple]:
    """``key``'s first-use group where ``key`` is not built here: the builds of it this CPU can use that are
    neither built nor failed before."""
    for group in FIRST_USE_GROUPS:
        if key in {_key(*b) for b, _ in group} and not build.is_built(spec(*key)):
            no_amx = os.environ.get("QASR_NO_AMX") == "1"
            usable = [b for b, needs in group if needs <= cpu_flags() and not (no_amx and "amx_tile" in needs)]
            return [b for b in usable if _key(*b) not in _modules and not build.is_built(spec(*b))
                    and build.failure_file(spec(*b)) is None]
    return []
