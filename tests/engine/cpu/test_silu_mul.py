"""SiLU(gate) * up in one native pass (decoder_ops.cpp, engine/cpu/silu_mul.py): the SiLU is a table of torch's own
F.silu over all 65,536 bf16 values, so the pass gives torch's bits wherever the result is a number; the decoder
computes the same logits with and without it."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from conftest import same_bits
from test_decoder_plan import DIMS, packed_forward  # the plan tests' model and three packed forwards

from qasr.engine.cpu import native, selftest
from qasr.engine.cpu.activation_tables import every_bf16, native_silu_mul, silu_table
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.model.checkpoint import load_checkpoint
from qasr.model.kernels import Kernels, torch_silu_mul
from qasr.testing import make_tiny_checkpoint

ops = native.decoder_ops_kernel()
needs_ops = pytest.mark.skipif(ops is None, reason="no C++ compiler for the native kernels")


def halves(z: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up column halves of one (rows, 2 * width) product, as the quantized modes hand them over."""
    return z[:, :width], z[:, width:]


@pytest.mark.parametrize("width", [3072, 40, 7])
def test_torchs_bf16_silu_is_the_table_on_rows_of_any_width(width: int) -> None:
    """What the table rests on: every bf16 value, placed in the gate half of rows `width` wide (whole vectors,
    vectors and a tail, a tail alone), gets the table's SiLU from torch."""
    x = every_bf16()
    x = torch.cat([x, x[: (-x.numel()) % width]])  # whole rows
    gate = x.view(-1, width)
    z = torch.cat([gate, torch.ones_like(gate)], 1)
    g, _ = halves(z, width)
    table = silu_table()
    assert table.shape == (1 << 16,) and table.dtype == torch.float32
    looked_up = table[g.contiguous().view(torch.int16).long() & 0xFFFF].to(torch.bfloat16)
    assert same_bits(F.silu(g), looked_up)


@needs_ops
@pytest.mark.parametrize(("rows", "width"), [(1, 3072), (5, 3072), (300, 3072), (3, 40), (2, 7), (4, 1), (0, 16)])
def test_the_native_pass_gives_torchs_bits(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + width)
    z = (torch.randn(rows, 2 * width, generator=gen) * 6).to(torch.bfloat16)
    if rows:
        z.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e4, -1e4, 3e38, -3e38])  # zeros, large values, overflow
    gate, up = halves(z, width)
    got = ops.silu_mul(gate, up, silu_table())
    assert got.shape == (rows, width) and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), (F.silu(gate) * up).view(torch.int16))
    # contiguous inputs, and inputs whose rows are not contiguous (the pass copies those), give the same
    assert torch.equal(ops.silu_mul(gate.contiguous(), up.contiguous(), silu_table()), got)
    assert torch.equal(ops.silu_mul(gate.t().contiguous().t(), up, silu_table()), got)


@needs_ops
def test_every_gate_value_through_the_native_pass() -> None:
    """All 65,536 gate values times a few factors: torch's bits, NaN where torch gives NaN (inf * 0 included)."""
    x = every_bf16()
    for factor in (1.0, -0.5, 3.0, 0.0, float("inf")):
        gate = x.view(-1, 256)
        up = torch.full_like(gate, factor)
        assert same_bits(ops.silu_mul(gate, up, silu_table()), F.silu(gate) * up), factor


@needs_ops
def test_the_native_pass_refuses_what_it_cannot_read() -> None:
    gate = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.silu_mul(gate, torch.zeros(2, 9, dtype=torch.bfloat16), silu_table())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.silu_mul(gate.float(), gate.float(), silu_table())
    with pytest.raises(RuntimeError, match="65,536 float32"):
        ops.silu_mul(gate, gate, silu_table()[:100])
    with pytest.raises(RuntimeError, match="65,536 float32"):
        ops.silu_mul(gate, gate, silu_table().to(torch.bfloat16))


@needs_ops
def test_the_bound_form_falls_back_to_torch_where_the_pass_does_not_apply() -> None:
    silu_mul = native_silu_mul(ops)
    x = torch.randn(2, 3, 8)
    assert torch.equal(silu_mul(x, x), F.silu(x) * x)  # float32
    xb = x.to(torch.bfloat16)
    assert torch.equal(silu_mul(xb, xb), F.silu(xb) * xb)  # three dimensions


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Path
    return make_tiny_checkpoint(tmp_path_factory.mktemp("silu"), seed=4, **DIMS)


@needs_ops
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_prepare_plugs_the_pass_in_and_the_logits_are_the_same_without_it(path, quantize) -> None:  # noqa: ANN001
    ck = load_checkpoint(path, device="cpu", dtype="bfloat16")
    prepared = prepare_cpu(ck.model, True, quantize)
    assert prepared.kernels.silu_mul is not torch_silu_mul and "fused norms and SiLU * up" in prepared.description
    calls = []
    fused = prepared.kernels.silu_mul

    def counted(gate, up):  # noqa: ANN001, ANN202
        calls.append(gate.shape)
        return fused(gate, up)

    with_pass = replace(prepared.kernels, silu_mul=counted, decoder_layers=None)  # the module tree, counted
    without = replace(prepared.kernels, silu_mul=torch_silu_mul, decoder_layers=None)
    got, want = packed_forward(ck, with_pass, prepared, "auto"), packed_forward(ck, without, prepared, "auto")
    assert len(calls) == 3 * ck.config.decoder.num_hidden_layers
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_float32_keeps_torchs_silu() -> None:
    """The table is of bf16 values: a float32 model runs F.silu(gate) * up itself."""
    x = torch.randn(3, 8)
    assert Kernels().silu_mul(x, x).equal(F.silu(x) * x)


# --- the self-test: a correct module written in torch passes, a broken one is refused ---------------------------

def fake_ops(silu_mul) -> ModuleType:  # noqa: ANN001
    mod = ModuleType("fake_decoder_ops")
    mod.silu_mul = silu_mul
    return mod


def truncated_product(gate, up, table):  # noqa: ANN001, ANN201 - the float32 product cut to bf16, not rounded
    bits = (F.silu(gate).float() * up.float()).view(torch.int32) >> 16
    return bits.to(torch.int16).view(torch.bfloat16)


def test_a_correct_torch_silu_mul_passes_and_broken_ones_are_refused(caplog) -> None:  # noqa: ANN001
    selftest.check_silu_mul(fake_ops(lambda gate, up, table: F.silu(gate) * up))
    for broken in (truncated_product, lambda g, u, t: torch.sigmoid(g) * u):
        with pytest.raises(selftest.SelfTestFailure, match="silu_mul"):
            selftest.check_silu_mul(fake_ops(broken))
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert selftest.verified("decoder ops", fake_ops(lambda g, u, t: torch.sigmoid(g) * u),
                                 selftest.check_silu_mul) is None
    assert sum(r.levelno >= logging.WARNING for r in caplog.records) == 1
