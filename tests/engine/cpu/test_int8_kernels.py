"""qasr's int8 W8A8 kernels (AMX-INT8, AVX512-VNNI, 256-bit AVX-VNNI): bit for bit the torch reference of the
spec on odd shapes and both input dtypes, every row independent of the call it is in, the packed layout as
documented, and a kernel that gives wrong numbers is disabled by its self-test with one warning (the loader
falls back)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch.utils.cpp_extension import include_paths

from qasr.engine.cpu import native, selftest
from qasr.engine.cpu.int8 import int8_linear_reference, patch_rows, quantize_rows_reference

LOADERS = {"amx": (native.amx_int8_kernel, native.AMX_INT8_CPU, "AMX-INT8 linear"),
           "vnni": (native.vnni_int8_kernel, native.VNNI_CPU, "AVX512-VNNI int8 linear"),
           "avx_vnni": (native.avx_vnni_int8_kernel, native.AVX_VNNI_CPU, "AVX-VNNI int8 linear")}


def _available(name: str) -> ModuleType | None:
    loader, needs, _ = LOADERS[name]
    if os.environ.get("QASR_NO_NATIVE") == "1" or not needs <= native.cpu_flags():
        return None
    if name == "amx" and os.environ.get("QASR_NO_AMX") == "1":
        return None
    return loader()


@pytest.fixture(scope="module", params=list(LOADERS))
def kernel(request: pytest.FixtureRequest) -> ModuleType:
    loader, needs, label = LOADERS[request.param]
    missing = sorted(needs - native.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (from /proc/cpuinfo): the {label} kernel is not built here")
    if os.environ.get("QASR_NO_NATIVE") == "1" or (request.param == "amx" and os.environ.get("QASR_NO_AMX") == "1"):
        pytest.skip("native kernels turned off by QASR_NO_NATIVE / QASR_NO_AMX")
    mod = loader()
    assert mod is not None, f"the CPU has {', '.join(sorted(needs))} but the {label} kernel did not build, " \
                            "load or pass its self-test"
    assert mod.supported()
    return mod


@pytest.fixture
def fresh() -> Iterator[None]:
    native.clear_caches()
    yield
    native.clear_caches()


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return w_q, torch.rand(n, generator=gen) * 0.02 + 1e-4


def _rows(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of magnitudes from e^-3 to e^3, every seventh row zero (a_scale 0)."""
    x = torch.randn(m, k, generator=gen) * torch.exp(6 * torch.rand(m, 1, generator=gen) - 3)
    x[3::7] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("k", [1, 3, 65, 1000])
@pytest.mark.parametrize("n", [1, 17, 300])
def test_linear_is_the_reference_bit_for_bit(kernel: ModuleType, dtype: torch.dtype, has_bias: bool, k: int,
                                            n: int) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w_q, w_scale = _weights(n, k, gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    packed = kernel.pack(w_q)
    for m in (1, 2, 17, 300):
        x = _rows(m, k, dtype, gen)
        got = kernel.linear(x, packed, n, w_scale, bias)
        ref = int8_linear_reference(x, w_q, w_scale, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, ref), f"M={m}: {int((got != ref).sum())} of {ref.numel()} values differ"


def test_a_short_last_block_and_many_row_chunks_on_any_thread_count(kernel: ModuleType) -> None:
    """A last column block of at most 32 columns runs on a narrower pass, and the threads split the work by its
    cost, chunk by chunk: N = 480 (7.5 blocks, the encoder convolutions'), 32 and 33 columns, 300 rows (several
    row chunks), on 1, 2 and 3 threads, are the reference bit for bit."""
    gen = torch.Generator().manual_seed(480)
    threads = torch.get_num_threads()
    try:
        for n in (480, 32, 33):
            w_q, w_scale = _weights(n, 65, gen)
            packed = kernel.pack(w_q)
            x = _rows(300, 65, torch.bfloat16, gen)
            ref = int8_linear_reference(x, w_q, w_scale, None)
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                got = kernel.linear(x, packed, n, w_scale, None)
                assert torch.equal(got, ref), (n, t, int((got != ref).sum()))
    finally:
        torch.set_num_threads(threads)


def test_every_row_is_the_same_whatever_the_call(kernel: ModuleType) -> None:
    """One row alone, and at the start, middle and end of 2-, 17- and 300-row calls (other rows random),
    gives the same bits; the call's size and the row's position never matter."""
    gen = torch.Generator().manual_seed(3)
    k, n = 1000, 300
    w_q, w_scale = _weights(n, k, gen)
    bias = torch.randn(n, generator=gen)
    packed = kernel.pack(w_q)
    for dtype in (torch.bfloat16, torch.float32):
        row = _rows(1, k, dtype, gen)
        alone = kernel.linear(row, packed, n, w_scale, bias)
        for m in (2, 17, 300):
            for at in (0, m // 2, m - 1):
                x = _rows(m, k, dtype, gen)
                x[at] = row[0]
                assert torch.equal(kernel.linear(x, packed, n, w_scale, bias)[at], alone[0]), (dtype, m, at)


def test_quantize_rows_is_the_reference(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        for k in (1, 15, 16, 17, 1000):
            x = _rows(40, k, dtype, gen)
            q, scale = kernel.quantize_rows(x)
            q_ref, scale_ref = quantize_rows_reference(x)
            assert q.dtype == torch.int8 and scale.dtype == torch.float32
            assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref), (dtype, k)
    # inv = 127 / 127 = 1: the products are the values themselves, so halves round to even
    x = torch.tensor([[127.0, 2.5, 3.5, -0.5, -1.5, 126.5, -127.0]])
    q, scale = kernel.quantize_rows(x)
    assert q.tolist() == [[127, 2, 4, 0, -2, 126, -127]] and scale.item() == 1.0
    # the same in bf16 rows long enough for the 64-value integer loop (and its tail): ties to even there too
    for k in (64, 135):
        q, scale = kernel.quantize_rows(x.repeat(1, 20)[:, :k].to(torch.bfloat16))
        assert q.tolist() == [([127, 2, 4, 0, -2, 126, -127] * 20)[:k]] and scale.item() == 1.0, k
    q, scale = kernel.quantize_rows(torch.zeros(2, 5, dtype=torch.bfloat16))
    assert not q.any() and not scale.any()


def test_tiny_and_non_finite_rows_follow_the_reference(kernel: ModuleType) -> None:
    """Where 127 / a_amax overflows (a_amax < 2^-121: 0 * inf is NaN), and rows holding inf or NaN: the
    reference's torch ops decide (NaN propagates into a_scale, NaN products quantize to 0); the kernel gives
    the same bits, NaN for NaN."""
    inf, nan = float("inf"), float("nan")
    rows = [[1e-39, 0.0, 5e-40, -1e-39, 0.0], [3e-37, 0.0, -1e-37, 0.0, 2e-38], [inf, 1.0, 0.0, -2.0, 0.0],
            [nan, 1.0, 0.0, -2.0, 0.0], [1.0, -inf, 0.5, inf, 0.0], [0.0, 0.0, 0.0, 0.0, nan]]
    gen = torch.Generator().manual_seed(9)
    w_q, w_scale = _weights(20, 5, gen)
    bias = torch.randn(20, generator=gen)
    packed = kernel.pack(w_q)
    for dtype in (torch.float32, torch.bfloat16):
        for k in (5, 21, 70):  # vector tails, whole vectors and bf16's 64-value loop (the rows repeated)
            x = torch.tensor(rows).repeat(1, (k + 4) // 5)[:, :k].to(dtype)
            q, s = kernel.quantize_rows(x)
            q_ref, s_ref = quantize_rows_reference(x)
            assert torch.equal(q, q_ref), (dtype, k, q, q_ref)
            assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32)), (dtype, k, s, s_ref)
            if k == 5:
                got = kernel.linear(x, packed, 20, w_scale, bias)
                ref = int8_linear_reference(x, w_q, w_scale, bias)
                assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_linear_releases_the_gil(kernel: ModuleType) -> None:
    """While a long product (at least 100 ms) runs in one thread, a Python loop in another keeps going: its
    longest pause stays below one call's time, which it would last at least with the GIL held (one thread
    for the kernel, so the loop has the other CPU; the margin is for a busy machine's scheduling)."""
    gen = torch.Generator().manual_seed(10)
    w_q, w_scale = _weights(2048, 2048, gen)
    packed = kernel.pack(w_q)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, call = 256, 0.0
        while call < 0.1 and m <= 16384:
            m *= 2
            x = _rows(m, 2048, torch.bfloat16, gen)
            start = time.perf_counter()
            kernel.linear(x, packed, 2048, w_scale)
            call = time.perf_counter() - start
        done = threading.Event()

        def products() -> None:
            for _ in range(3):
                kernel.linear(x, packed, 2048, w_scale)
            done.set()

        worker = threading.Thread(target=products)
        worker.start()
        longest, last = 0.0, time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert longest < 0.8 * call, (longest, call)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("cin", "stride"), [(480, (2, 2)), (37, (2, 1)), (1, (1, 1))])
def test_conv_is_linear_on_the_im2col_rows(kernel: ModuleType, dtype: torch.dtype, cin: int,
                                           stride: tuple[int, int]) -> None:
    """The conv entry reads each 3x3 patch in place from the padded NHWC input: the same bits as linear() on the
    explicit im2col rows (the encoder's 480-channel stride-2 shape among them), and an image's rows the same
    alone as in a batch of three."""
    gen = torch.Generator().manual_seed(cin)
    w_q, w_scale = _weights(70, 9 * cin, gen)
    bias = torch.randn(70, generator=gen)
    packed = kernel.pack(w_q)
    xp = (torch.randn(3, 11, 9, cin, generator=gen) * torch.exp(4 * torch.rand(3, 11, 1, 1, generator=gen) - 2))
    xp[1, :, :3] = 0  # patches wholly in the zero padding: a_scale 0, the output is the bias
    xp = xp.to(dtype)
    got = kernel.conv(xp, packed, 70, w_scale, bias, 3, 3, *stride)
    rows = patch_rows(xp, 3, 3, *stride)
    assert got.dtype == dtype and torch.equal(got, kernel.linear(rows, packed, 70, w_scale, bias))
    assert torch.equal(got, int8_linear_reference(rows, w_q, w_scale, bias))
    per_image = got.shape[0] // 3
    alone = kernel.conv(xp[2:3].contiguous(), packed, 70, w_scale, bias, 3, 3, *stride)
    assert torch.equal(alone, got[2 * per_image:])


def test_conv_refuses_what_it_cannot_read(kernel: ModuleType) -> None:
    w_q, w_scale = _weights(8, 9 * 4, torch.Generator().manual_seed(0))
    packed = kernel.pack(w_q)
    with pytest.raises(RuntimeError, match="kernel larger"):
        kernel.conv(torch.zeros(1, 2, 5, 4), packed, 8, w_scale, None, 3, 3, 1, 1)
    with pytest.raises(RuntimeError, match="packed weight"):  # K = 3 * 3 * 5 does not match the packed 36
        kernel.conv(torch.zeros(1, 5, 5, 5), packed, 8, w_scale, None, 3, 3, 1, 1)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.conv(torch.zeros(1, 5, 5, 4, dtype=torch.float64), packed, 8, w_scale, None, 3, 3, 1, 1)


def test_an_empty_call_gives_an_empty_result(kernel: ModuleType) -> None:
    w_q, w_scale = _weights(17, 65, torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float32):
        out = kernel.linear(torch.zeros(0, 65, dtype=dtype), kernel.pack(w_q), 17, w_scale, torch.ones(17))
        assert out.shape == (0, 17) and out.dtype == dtype


def test_a_zero_input_gives_the_bias(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    w_q, w_scale = _weights(70, 33, gen)
    bias = torch.randn(70, generator=gen)
    packed = kernel.pack(w_q)
    assert torch.equal(kernel.linear(torch.zeros(3, 33), packed, 70, w_scale, bias), bias.expand(3, 70))
    assert not kernel.linear(torch.zeros(3, 33), packed, 70, w_scale, None).any()
    assert kernel.linear(torch.zeros(0, 33), packed, 70, w_scale, bias).shape == (0, 70)


def test_long_k_is_exact_where_the_shifted_sum_overflows(kernel: ModuleType) -> None:
    """K = 70000 at full scale: acc = 127 * 127 * 70000 fits int32 but the VNNI kernel's shifted sum
    (x_q + 128) * w does not: it wraps, and so does the subtraction of the column sums, exactly."""
    k = 70000
    x = torch.full((2, k), 3.0)
    x[1, ::2] = -3.0
    w_q = torch.full((16, k), 127, dtype=torch.int8)
    w_q[5] = -127
    w_scale = torch.ones(16)
    got = kernel.linear(x, kernel.pack(w_q), 16, w_scale, None)
    assert torch.equal(got, int8_linear_reference(x, w_q, w_scale))
    assert got[0, 0].item() == pytest.approx(3.0 * 127 * k, rel=1e-6) and got[0, 5].item() < 0


def test_pack_layout(kernel: ModuleType) -> None:
    """Header (magic, N, K, K padded to 64), then blocks of (K/4 groups, 64 columns, 4 values), zero past N
    and K, then 128 x every column's sum as int32."""
    gen = torch.Generator().manual_seed(6)
    n, k = 70, 67
    w_q, _ = _weights(n, k, gen)
    packed = kernel.pack(w_q)
    kp, blocks = 128, 2
    assert packed.dtype == torch.int8 and packed.dim() == 1
    assert packed.numel() == 64 + blocks * kp * 64 + blocks * 64 * 4
    raw = packed.numpy()
    assert raw[:32].view(np.int64)[1:].tolist() == [n, k, kp]
    body = raw[64:64 + blocks * kp * 64].reshape(blocks, kp // 4, 64, 4)
    want = np.zeros((blocks * 64, kp), dtype=np.int8)
    want[:n, :k] = w_q.numpy()
    # block b, group g, column c, value j = w[64 b + c, 4 g + j]
    assert np.array_equal(body.transpose(0, 2, 1, 3).reshape(blocks * 64, kp), want)
    comp = raw[64 + blocks * kp * 64:].view(np.int32)
    assert comp.tolist() == (128 * want.astype(np.int64).sum(1)).tolist()


def test_a_mismatched_packed_weight_is_refused(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(7)
    w_q, w_scale = _weights(20, 40, gen)
    packed = kernel.pack(w_q)
    with pytest.raises(RuntimeError, match="packed weight"):
        kernel.linear(torch.randn(2, 41), packed, 20, w_scale, None)  # K 41 pads to the same size as 40
    with pytest.raises(RuntimeError, match="packed weight"):
        kernel.linear(torch.randn(2, 40), packed, 19, w_scale[:19], None)
    with pytest.raises(RuntimeError, match="packed weight"):
        kernel.linear(torch.randn(2, 40), w_q.flatten(), 20, w_scale, None)
    with pytest.raises(RuntimeError, match="at most 132104"):
        kernel.pack(torch.zeros(1, 132105, dtype=torch.int8))  # 128 x its column sum could overflow int32


def test_weights_packed_by_one_kernel_serve_the_others() -> None:
    mods = [m for m in (_available(name) for name in LOADERS) if m is not None]
    if len(mods) < 2:
        pytest.skip("needs two of the int8 kernels on this CPU")
    gen = torch.Generator().manual_seed(8)
    w_q, w_scale = _weights(130, 200, gen)
    x = _rows(33, 200, torch.bfloat16, gen)
    first = mods[0].linear(x, mods[0].pack(w_q), 130, w_scale)
    for mod in mods[1:]:
        assert torch.equal(mod.pack(w_q), mods[0].pack(w_q))
        assert torch.equal(mod.linear(x, mods[0].pack(w_q), 130, w_scale), first), mod.KIND


# Compiled with explicit instruction-set flags instead of -march=native, so the paths are checked on machines
# that cannot run them (an AMD EPYC without AMX, a CPU without AVX-512): compile only, then look for the
# instructions each must use.
EXPLICIT = {
    "amx_int8.cpp": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
                     ["ldtilecfg", "tileloadd", "tdpbssd", "tilestored", "vpdpbusd"]),
    "int8_linear.cpp": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"], ["vpdpbusd"]),
    "int8_avx_vnni.cpp": (["-mavx2", "-mavxvnni"], ["{vex} vpdpbusd"]),
}


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("objdump") is None, reason="no c++ or objdump")
@pytest.mark.parametrize("source", list(EXPLICIT))
def test_each_kernel_compiles_with_explicit_flags(source: str) -> None:
    flags, instructions = EXPLICIT[source]
    src = native.CSRC / source
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + " ".join(flags).encode() + torch.__version__.encode())
    out = Path(tempfile.gettempdir()) / f"qasr_int8_check_{key.hexdigest()[:16]}.o"
    if not out.exists():  # the same source was checked before: reuse the object (a compile takes ~30 s)
        inc = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
        cmd = ["c++", "-std=c++20", "-fPIC", "-O1", "-fopenmp", "-ffp-contract=off",
               "-DTORCH_EXTENSION_NAME=qasr_int8_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *inc, *flags,
               "-c", str(src), "-o", str(out.with_suffix(".tmp.o"))]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        out.with_suffix(".tmp.o").replace(out)
    asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True, check=True).stdout
    for instruction in instructions:
        assert instruction in asm, f"{instruction} missing: the path was compiled out"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to look at the compiled instructions")
def test_the_avx_vnni_build_has_no_avx512_instructions() -> None:
    """It is for CPUs without AVX-512: its built module must hold no zmm register and use the VEX (AVX-VNNI)
    encoding of vpdpbusd, also when built on a CPU that has AVX-512 (as this one may)."""
    mod = _available("avx_vnni")
    if mod is None:
        pytest.skip("this CPU has no AVX-VNNI (avx2 and avx_vnni in /proc/cpuinfo)")
    asm = subprocess.run(["objdump", "-d", mod.__file__], capture_output=True, text=True, check=True).stdout
    assert "zmm" not in asm and "{vex} vpdpbusd" in asm


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to look at the compiled instructions")
def test_no_fused_multiply_add_in_the_built_kernel(kernel: ModuleType) -> None:
    """The epilogue rounds its multiply and its add separately; a fused one rounds once and differs in rare
    values a random self-test may miss. The builds use -ffp-contract=off; this checks the result."""
    asm = subprocess.run(["objdump", "-d", kernel.__file__], capture_output=True, text=True, check=True).stdout
    fused = [line for line in asm.splitlines() if any(op in line for op in ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub"))]
    assert not fused, fused[:3]


# --- the self-test, on torch stand-ins and on the real modules ------------------------------------------------

def torch_int8(linear=None, quantize_rows=quantize_rows_reference, conv=None) -> ModuleType:  # noqa: ANN001
    """A correct int8 module in plain torch (the "packed" weight is the weight), or one with a broken part."""
    mod = ModuleType("fake_int8")
    mod.supported = lambda: True
    mod.KIND = "torch"
    mod.pack = lambda w: w.contiguous()
    mod.quantize_rows = quantize_rows
    mod.linear = linear or (lambda x, p, n, ws, b=None: int8_linear_reference(x, p, ws, b))
    mod.conv = conv or (lambda xp, p, n, ws, b, kh, kw, sh, sw:
                        int8_linear_reference(patch_rows(xp, kh, kw, sh, sw), p, ws, b))
    return mod


def conv_one_ulp_off(xp, p, n, ws, b, kh, kw, sh, sw):  # noqa: ANN001, ANN201
    return one_ulp_off(patch_rows(xp, kh, kw, sh, sw), p, n, ws, b)


def one_ulp_off(x, p, n, ws, b=None):  # noqa: ANN001, ANN201
    out = int8_linear_reference(x, p, ws, b)
    return torch.nextafter(out, torch.tensor(float("inf"), dtype=out.dtype))


def batch_dependent(x, p, n, ws, b=None):  # noqa: ANN001, ANN201
    """Right in big calls, one ulp off in calls of one or two rows."""
    return int8_linear_reference(x, p, ws, b) if x.shape[0] > 2 else one_ulp_off(x, p, n, ws, b)


def with_fma(x, p, n, ws, b=None):  # noqa: ANN001, ANN201
    """The epilogue fused into one rounding (float64 then float32), as an FMA-contracted build would."""
    q, s = quantize_rows_reference(x)
    acc = q.long() @ p.long().t()
    y = acc.double() * (s[:, None] * ws[None, :]).double() + (0 if b is None else b.double())
    return y.float().to(x.dtype)


def truncating_quantize(x):  # noqa: ANN001, ANN201
    q, s = quantize_rows_reference(x)
    return torch.trunc(x.float() / s.clamp_min(1e-30)[:, None]).clamp(-127, 127).to(torch.int8), s


def test_a_correct_torch_int8_module_passes() -> None:
    selftest.check_int8_gemm(torch_int8())  # the check demands what is right, not what our kernels do


@pytest.mark.parametrize(("broken", "message"), [
    (torch_int8(linear=one_ulp_off), "differ from the reference"),
    (torch_int8(linear=batch_dependent), "alone differ"),
    (torch_int8(linear=with_fma), "differ from the reference"),
    (torch_int8(quantize_rows=truncating_quantize), "quantize_rows"),
    (torch_int8(conv=conv_one_ulp_off), "int8 conv"),
], ids=["one-ulp", "batch-dependent", "fma", "truncating-quantize", "conv-one-ulp"])
def test_a_broken_int8_module_is_rejected_with_one_warning(broken: ModuleType, message: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert selftest.verified("broken int8", broken, selftest.check_int8_gemm) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "broken int8" in warnings[0].getMessage()
    assert message in warnings[0].getMessage(), warnings[0].getMessage()


def test_the_loader_falls_back_from_a_failing_amx_kernel(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """On stand-ins (any CPU): AMX-INT8 made to fail -> int8_kernel() is the VNNI one, with one warning."""
    good, bad = torch_int8(), torch_int8(linear=one_ulp_off)
    modules = {native.AMX_INT8[0]: bad, native.INT8_VNNI[0]: good, native.AVX_VNNI[0]: torch_int8()}
    monkeypatch.setattr(native, "_build", lambda name, *a: modules[name])
    monkeypatch.setattr(native, "cpu_flags", lambda: native.AMX_INT8_CPU | native.VNNI_CPU | native.AVX_VNNI_CPU)
    monkeypatch.delenv("QASR_NO_AMX", raising=False)
    monkeypatch.delenv("QASR_NO_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert native.int8_kernel() is good
        assert native.int8_kernel() is good  # cached: the self-test ran once
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "AMX-INT8 linear" in warnings[0], warnings
    monkeypatch.setenv("QASR_NO_AMX", "1")
    native.clear_caches()
    assert native.amx_int8_kernel() is None and native.int8_kernel() is good


def test_the_real_kernel_made_to_fail_is_disabled(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """This CPU's first-choice kernel with its linear patched to return wrong values: the loader warns once
    and hands out the next one (AVX512-VNNI after AMX-INT8, AVX-VNNI after that, else None)."""
    chain = [(LOADERS[name][2], m) for name in LOADERS if (m := _available(name)) is not None]
    if not chain:
        pytest.skip("no native int8 kernel on this CPU (needs amx_int8, avx512_vnni or avx_vnni)")
    (label, first), fallback = chain[0], chain[1][1] if len(chain) > 1 else None
    native.clear_caches()
    monkeypatch.setattr(first, "linear", lambda x, p, n, ws, b=None: torch.zeros(x.shape[0], n, dtype=x.dtype))
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert native.int8_kernel() is fallback
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and label in warnings[0], warnings
