"""qasr's AMX-BF16 linear kernel: it compiles everywhere, it stands down without AMX, and its products are
right and row-invariant -- on AMX hardware where this CPU has it, and always on a scalar model of the tile
instructions (tests/amx_emulate.h), which checks the kernel's indexing on CPUs without AMX."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from qasr.engine.cpu import native

HERE = Path(__file__).resolve().parents[2]  # tests/, where amx_emulate.h lives
SOURCE = native.CSRC / "amx_linear.cpp"
# The AMX path needs these and nothing host-specific: it must compile on any x86-64 build machine.
EXPLICIT_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
HOST_AMX = {"amx_bf16", "amx_tile"} <= native.cpu_flags()


def emulated_kernel() -> ModuleType | None:
    mod = native._build("qasr_amx_linear_emulated", "amx_linear.cpp", ("-DQASR_AMX_EMULATE",), (str(HERE),))
    return mod if mod is not None and mod.supported() else None


def hardware_kernel() -> ModuleType | None:
    return native.amx_kernel()


@pytest.fixture(scope="module", params=["emulated", "hardware"])
def kernel(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "emulated":
        mod = emulated_kernel()
        if mod is None:
            pytest.skip("the emulated AMX kernel needs a compiler and an AVX512-BF16 CPU (its epilogue)")
        assert mod.emulated()
    else:
        if not HOST_AMX:
            pytest.skip("this CPU has no AMX-BF16 (amx_bf16/amx_tile not in /proc/cpuinfo): hardware path not run")
        mod = hardware_kernel()
        assert mod is not None, "the CPU has AMX but the AMX kernel did not build, load or pass its self-test"
        assert not mod.emulated()
    return mod


def _compile_only(out: Path) -> subprocess.CompletedProcess[str]:
    from torch.utils.cpp_extension import include_paths

    inc = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["c++", "-std=c++20", "-fPIC", "-O1", "-fopenmp", "-DTORCH_EXTENSION_NAME=qasr_amx_compile_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *inc, *EXPLICIT_FLAGS, "-c", str(SOURCE), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_amx_path_compiles_with_explicit_flags() -> None:
    """Catches a syntax or type error in the AMX path on machines that cannot run it (compile only)."""
    headers = b"".join(h.read_bytes() for h in sorted(SOURCE.parent.glob("*.h")))  # gemm_common.h
    key = hashlib.sha256(SOURCE.read_bytes() + headers + " ".join(EXPLICIT_FLAGS).encode() + torch.__version__.encode())
    out = Path(tempfile.gettempdir()) / f"qasr_amx_check_{key.hexdigest()[:16]}.o"
    if not out.exists():  # the same source was checked before: reuse the object (compiling takes ~30 s)
        result = _compile_only(out.with_suffix(".tmp.o"))
        assert result.returncode == 0, result.stderr[-4000:]
        out.with_suffix(".tmp.o").replace(out)
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to look at the compiled instructions")
    asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True, check=True).stdout
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in asm, f"{instruction} missing: the AMX path was compiled out"


@pytest.mark.skipif(HOST_AMX or not {"avx512_bf16", "avx512bw", "avx512vl"} <= native.cpu_flags(),
                    reason="needs a CPU without AMX but with AVX512-BF16 (to load a build made for AMX)")
def test_amx_build_stands_down_on_a_cpu_without_amx() -> None:
    """The production flags force the AMX path in; on this CPU supported() is False and nothing runs."""
    mod = native._build("qasr_amx_linear_forced", "amx_linear.cpp", native.AMX_FLAGS)
    if mod is None:
        pytest.skip("no compiler")
    assert not mod.supported() and not mod.emulated()
    w = torch.randn(70, 96).to(torch.bfloat16)
    packed = mod.pack(w)  # packing is plain C++ and allowed
    with pytest.raises(RuntimeError, match="lacks AMX"):
        mod.linear(torch.randn(3, 96).to(torch.bfloat16), packed, 70, None)


def packed_reference(w: torch.Tensor) -> torch.Tensor:
    """The documented layout, (N_pad/64, K/2, 64, 2), built in torch: zero columns pad N to 64."""
    n, k = w.shape
    full = torch.zeros(-(-n // 64) * 64, k, dtype=w.dtype)
    full[:n] = w
    return full.view(-1, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(("n", "k"), [(130, 70), (17, 2), (1000, 256), (64, 1024)])
def test_pack_is_the_documented_layout(kernel: ModuleType, n: int, k: int) -> None:
    """Both kernels read weights in this layout (one pack serves either, gemm_common.h)."""
    w = torch.randn(n + 3, k + 4).to(torch.bfloat16)[3:, 4:]  # not contiguous
    assert torch.equal(kernel.pack(w), packed_reference(w))
    w = torch.randn(n * k + 1).to(torch.bfloat16)[1:].view(n, k)  # contiguous at an odd element offset
    assert torch.equal(kernel.pack(w), packed_reference(w))


def product(kernel: ModuleType, lin: nn.Linear):  # noqa: ANN201 - x -> the layer's output on the kernel
    packed = kernel.pack(lin.weight.detach())
    bias = None if lin.bias is None else lin.bias.detach().float()

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = kernel.linear(x.reshape(-1, x.shape[-1]), packed, lin.out_features, bias)
        return out.view(*x.shape[:-1], lin.out_features)

    return forward


def make_linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize(("k", "n", "bias"), [(64, 64, False), (256, 1000, True), (3072, 96, False), (2, 17, True),
                                              (70, 67, True), (1056, 130, False)])
def test_matches_float32_product(kernel: ModuleType, k: int, n: int, bias: bool) -> None:
    lin = make_linear(k, n, bias)
    x = torch.randn(23, k, dtype=torch.bfloat16)
    got = product(kernel, lin)(x).float()
    want = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
    # float32 accumulation, one bf16 rounding of the result: relative error within 2^-8 (+ summation slack)
    assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize(("k", "n"), [(1024, 200), (70, 67), (96, 130)])
def test_rows_are_batch_invariant(kernel: ModuleType, k: int, n: int) -> None:
    """Every row remainder 1..33 of the 32-row items, at offsets inside and across them, and several items."""
    lin = product(kernel, make_linear(k, n, bias=True, seed=1))
    x = torch.randn(100, k, dtype=torch.bfloat16)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(100)])
    for m in range(1, 34):
        for offset in (0, 3, 29, 100 - m):
            assert torch.equal(lin(x[offset:offset + m]), alone[offset:offset + m]), (m, offset)
    for m in (64, 65, 97, 100):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    # a 3-D input is the same product row by row
    assert torch.equal(lin(x[:60].view(3, 20, k)).view(60, n), alone[:60])


def test_empty_and_single_column(kernel: ModuleType) -> None:
    w = torch.randn(1, 64).to(torch.bfloat16)
    packed = kernel.pack(w)
    assert kernel.linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, 1, None).shape == (0, 1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    want = x.float() @ w.float().T
    assert torch.allclose(kernel.linear(x, packed, 1, None).float(), want, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize(("cin", "cout", "kernel_size", "stride"), [(32, 48, (3, 3), (2, 2)), (48, 40, (3, 3), (2, 2)),
                                                                     (6, 70, (3, 3), (2, 1)), (8, 16, (1, 4), (1, 2))])
def test_conv_matches_conv2d_and_is_batch_invariant(kernel: ModuleType, cin: int, cout: int,
                                                    kernel_size: tuple[int, int], stride: tuple[int, int]) -> None:
    """The implicit-im2col convolution over a padded NHWC input, as torch's Conv2d computes it."""
    torch.manual_seed(3)
    conv = nn.Conv2d(cin, cout, kernel_size, stride, padding=1).to(torch.bfloat16)
    x = torch.randn(5, cin, 31, 25, dtype=torch.bfloat16)
    want = torch.nn.functional.conv2d(x.float(), conv.weight.float(), conv.bias.float(), stride, padding=1)
    kh, kw = kernel_size
    w = conv.weight.detach().permute(0, 2, 3, 1).reshape(cout, -1).contiguous()  # (cout, kh*kw*cin)
    packed = kernel.pack(w)
    bias = conv.bias.detach().float()
    xp = torch.nn.functional.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1)).contiguous()  # (n, h+2, w+2, cin)
    got = kernel.conv(xp, packed, cout, bias, kh, kw, *stride)
    got = got.view(5, want.shape[2], want.shape[3], cout).permute(0, 3, 1, 2).float()
    assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-2 * want.abs().max().item())
    alone = torch.cat([kernel.conv(xp[i:i + 1].contiguous(), packed, cout, bias, kh, kw, *stride) for i in range(5)])
    assert torch.equal(kernel.conv(xp, packed, cout, bias, kh, kw, *stride), alone)
