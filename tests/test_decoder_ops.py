"""The fused bf16 decoder kernels compute what the plain torch modules compute."""

from __future__ import annotations

import pytest
import torch

from qasr.engine.cpu.native import decoder_ops_kernel
from qasr.model.decoder import RMSNorm, rotate_half
from qasr.model.kernels import Kernels

ops = decoder_ops_kernel()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the native kernels")


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    # the sum of squares may be added in another order: allow one bf16 rounding step
    return torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())


@pytest.mark.parametrize("shape", [(1, 1024), (37, 1024), (300, 896), (3, 5, 128)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(shape[-1], dtype=torch.bfloat16)
    x = (3 * torch.randn(shape)).to(torch.bfloat16)
    want = norm(x)
    got = norm(x, Kernels(rms_norm=ops.rms_norm, norm_rope=ops.norm_rope, fused_dtype=torch.bfloat16))
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert close_in_bf16(got, want)
    assert (got == want).float().mean() > 0.95  # mostly bit-identical, not merely close


@pytest.mark.parametrize(("n", "heads"), [(1, 16), (9, 8), (130, 16)])
def test_norm_rope_matches_torch(n: int, heads: int) -> None:
    torch.manual_seed(1)
    d = 128
    norm = RMSNorm(d, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(d, dtype=torch.bfloat16)
    x = torch.randn(n, heads, d).to(torch.bfloat16)
    angles = torch.rand(n, 1, d // 2) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    y = norm(x)
    want = y * cos + rotate_half(y) * sin
    got = ops.norm_rope(x, norm.weight, cos, sin, norm.eps)
    assert close_in_bf16(got, want)
    assert (got == want).float().mean() > 0.95
