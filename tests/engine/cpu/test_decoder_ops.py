"""The fused bf16 decoder kernels compute what the plain torch modules compute; the float forms (the same torch
ops composed in C++, one Python call) give exactly their bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import noise, prompt_for

from qasr.engine.config import EngineConfig
from qasr.engine.cpu.native import decoder_ops_kernel
from qasr.engine.engine import Engine, RequestSpec
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "heads", "d"), [(1, 4, 64), (9, 2, 128), (130, 16, 128)])
def test_float_forms_are_the_torch_ops_bit_for_bit(dtype: torch.dtype, n: int, heads: int, d: int) -> None:
    torch.manual_seed(2)
    norm = RMSNorm(d, 1e-6).to(dtype)
    norm.weight.data = torch.randn(d).to(dtype)
    x = (3 * torch.randn(n, heads, d)).to(dtype)
    emb = torch.rand(n, 1, d // 2).repeat(1, 1, 2) * 50
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    one_call = Kernels(rms_norm=ops.rms_norm_ops, norm_rope=ops.norm_rope_ops, fused_dtype=dtype)
    with torch.no_grad():
        y = norm(x)
        assert torch.equal(norm(x, one_call), y)
        assert torch.equal(norm(x[:, 0], one_call), norm(x[:, 0]))  # (N, C) rows, as the layer norms see them
        assert torch.equal(ops.norm_rope_ops(x, norm.weight, cos, sin, norm.eps), y * cos + rotate_half(y) * sin)


def test_a_float32_engine_takes_the_one_call_norms_and_keeps_its_tokens(ck) -> None:  # noqa: ANN001
    wave = noise(2.0, seed=3)
    tokens = []
    for native in (True, False):
        with Engine(ck, EngineConfig(native_kernels=native)) as engine:
            assert ("norms in one call" in engine.prepared.description) == native
            assert engine.prepared.kernels.fused(torch.zeros(1)) == native
            tokens.append(engine.submit(RequestSpec(prompt_for(ck, wave), 24, waveform=wave,
                                                    ignore_eos=True)).result(timeout=120).token_ids)
    assert tokens[0] == tokens[1]


# -------------------------------------------- the bf16 kernels' own arithmetic, bit for bit (numpy, in order)
def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even; NaN -> 0x7FC0, as c10::BFloat16), returned as float32."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    r[np.isnan(a)] = 0x7FC0
    return (r << 16).view(np.float32)


def rms_rows_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Each row: the float32 sum of squares added in index order, r = 1 / sqrt(sum / n + eps), then
    bf16(w * bf16(x * r)): the kernels' arithmetic, one IEEE rounding per step."""
    n = np.float32(x.shape[-1])
    sums = np.add.accumulate(x * x, axis=-1, dtype=np.float32)[..., -1:]  # sequential, unlike np.sum
    r = np.float32(1) / np.sqrt(sums / n + np.float32(eps))
    return bf16_round(w * bf16_round(x * r))


@pytest.mark.parametrize(("rows", "width"), [(1, 1024), (13, 1024), (300, 896), (9, 40)])
def test_rms_norm_is_its_arithmetic_bit_for_bit(rows: int, width: int) -> None:
    """Rows taken eight at a time and 16 values at a time give the bits of the row-by-row scalar arithmetic."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=g) * torch.logspace(-3, 4, rows)[:, None]).to(torch.bfloat16)
    w = torch.randn(width, generator=g).to(torch.bfloat16)
    want = rms_rows_reference(x.float().numpy(), w.float().numpy(), 1e-6)
    got = ops.rms_norm(x, w, 1e-6).float().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("n", "heads", "d"), [(1, 16, 128), (3, 8, 128), (37, 16, 128), (5, 4, 48)])
def test_norm_rope_is_its_arithmetic_bit_for_bit(n: int, heads: int, d: int) -> None:
    g = torch.Generator().manual_seed(n + d)
    x = (torch.randn(n, heads, d, generator=g) * 5).to(torch.bfloat16)
    w = torch.randn(d, generator=g).to(torch.bfloat16)
    angles = torch.rand(n, 1, d // 2, generator=g) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    y = rms_rows_reference(x.float().numpy(), w.float().numpy(), 1e-6)
    c, s = cos.float().numpy(), sin.float().numpy()
    rot = np.concatenate([-y[..., d // 2:], y[..., :d // 2]], axis=-1)
    want = bf16_round(bf16_round(y * c) + bf16_round(rot * s))
    got = ops.norm_rope(x, w, cos, sin, 1e-6).float().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
