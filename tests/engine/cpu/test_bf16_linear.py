"""qasr's AVX512-BF16 linear kernel: correct products, and a row never depends on its neighbours."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qasr.engine.cpu.conv import CpuConvs
from qasr.engine.cpu.linear import InvariantLinears
from qasr.engine.cpu.native import avx512_kernel

kernel = avx512_kernel()  # the AMX kernel has its own tests (test_amx_linear.py)
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX512-BF16 (or no compiler) on this machine")


def invariant(lin: nn.Linear):  # noqa: ANN201 - the module's product on the kernel
    linears = InvariantLinears(lin, kernel)
    return lambda x: linears(lin, x)


def make_linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize(("k", "n", "bias"), [(64, 64, False), (256, 1000, True), (3072, 96, False), (2, 17, True)])
def test_matches_float32_product(k: int, n: int, bias: bool) -> None:
    lin = make_linear(k, n, bias)
    x = torch.randn(23, k, dtype=torch.bfloat16)
    got = invariant(lin)(x).float()
    want = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
    # float32 accumulation, one bf16 rounding of the result: relative error within 2^-8 (+ summation slack)
    assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize(("k", "n"), [(1024, 1000), (3072, 1024), (96, 130)])
def test_rows_are_batch_invariant(k: int, n: int) -> None:
    lin = invariant(make_linear(k, n, bias=True, seed=1))
    x = torch.randn(150, k, dtype=torch.bfloat16)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(150)])
    for m in (1, 2, 5, 6, 7, 13, 37, 64, 150):  # every register-tile remainder and several row groups
        assert torch.equal(lin(x[:m]), alone[:m]), m
    # a 3-D input is the same product row by row
    assert torch.equal(lin(x[:60].view(3, 20, k)).view(60, n), alone[:60])


def test_invariant_linears_pack_every_linear_and_leave_the_model_alone() -> None:
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 8, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    before = model(x).float()
    linears = InvariantLinears(model, kernel)
    assert set(linears.packed) == {model[0], model[2]}
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]  # nothing swapped
    got = linears(model[2], model[1](linears(model[0], x))).float()
    assert torch.allclose(got, before, rtol=2 ** -6, atol=2e-2)


def test_gemm_conv_matches_conv2d_and_is_batch_invariant() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, 2, padding=1), nn.GELU(), nn.Conv2d(32, 48, 3, 2, padding=1),
                          nn.GELU(), nn.Conv2d(48, 40, 3, 2, padding=1)).to(torch.bfloat16)
    x = torch.randn(7, 1, 128, 100, dtype=torch.bfloat16)
    want = model(x).float()
    convs = CpuConvs(model, kernel)
    assert set(convs.gemm) == {model[2], model[4]}  # one input channel (odd kernel row) stays on oneDNN
    assert set(convs.others.channels_last) == {model[0]}

    def run(inp: torch.Tensor) -> torch.Tensor:
        for m in model:
            inp = convs(m, inp) if isinstance(m, nn.Conv2d) else m(inp)
        return inp

    got = run(x)
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want, rtol=2 ** -6, atol=2e-2 * want.abs().max().item())
    alone = torch.cat([run(x[i:i + 1]) for i in range(7)])
    assert torch.equal(got, alone)
