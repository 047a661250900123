"""GELU and zero padding between the encoder's convolutions in one pass (encoder_ops.cpp, engine/cpu/padded_input.py):
the GELU is a table of torch's own F.gelu over all 65,536 bf16 values, so the pass gives torch's bits, and the
convolutions give the same results with and without the native pass."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from conftest import same_bits
from torch import nn

from qasr.engine.cpu import native, selftest
from qasr.engine.cpu.activation_tables import every_bf16, gelu_table
from qasr.engine.cpu.conv import CpuConvs, padded_nhwc
from qasr.engine.cpu.int8 import Int8Convs
from qasr.engine.cpu.prepare import prepare_cpu

ops = native.encoder_ops_kernel()
needs_ops = pytest.mark.skipif(ops is None, reason="no C++ compiler for the native kernels")


def test_torchs_contiguous_bf16_gelu_is_one_function_of_the_value() -> None:
    """What the table rests on: on a contiguous tensor a value's GELU does not depend on where it sits (its lane
    in a vector, or a partial last vector), so one evaluation per value is torch's GELU everywhere there."""
    x, table = every_bf16(), gelu_table()
    assert table.shape == (1 << 16,) and table.dtype == torch.int16
    for offset in (0, 1, 7, 31):
        for length in (1 << 16, 45):  # whole vectors, and a short call ending in a partial one
            part = x[offset:offset + length].clone()
            assert same_bits(F.gelu(part), table[offset:offset + length].view(torch.bfloat16)), (offset, length)


def test_the_torch_path_is_gelu_of_the_contiguous_tensor_then_zero_padding() -> None:
    x = (torch.randn(2, 5, 6, 7) * 3).to(torch.bfloat16)  # (n, c, h, w)
    got = padded_nhwc(x, 1, 2, gelu=True)
    assert got.shape == (2, 6 + 2, 7 + 4, 5) and got.is_contiguous()
    assert torch.equal(got, F.pad(F.gelu(x.permute(0, 2, 3, 1).contiguous()), (0, 0, 2, 2, 1, 1)))
    assert torch.equal(padded_nhwc(x, 1, 1), F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1)))


@needs_ops
@pytest.mark.parametrize("channels", [480, 34, 1])
@pytest.mark.parametrize(("ph", "pw"), [(1, 1), (0, 2), (0, 0)])
def test_the_native_pass_gives_the_torch_paths_bits(channels: int, ph: int, pw: int) -> None:
    gen = torch.Generator().manual_seed(channels + 10 * ph + pw)
    x = (torch.randn(3, channels, 9, 5, generator=gen) * 4).to(torch.bfloat16)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    for layout in (x, x.contiguous(memory_format=torch.channels_last)):  # NCHW memory, and NHWC as the GEMMs leave it
        got = padded_nhwc(layout, ph, pw, gelu=True, ops=ops)
        assert got.is_contiguous() and same_bits(got, padded_nhwc(layout, ph, pw, gelu=True))
    assert ops.pad_gelu(x.permute(0, 2, 3, 1)[:, :, :0], gelu_table(), 1, 1).shape == (3, 11, 2, channels)


@needs_ops
def test_the_native_pass_refuses_what_it_cannot_read() -> None:
    x = torch.zeros(1, 3, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pad_gelu(x.float(), gelu_table(), 1, 1)
    with pytest.raises(RuntimeError, match="65,536"):
        ops.pad_gelu(x, gelu_table()[:100], 1, 1)
    with pytest.raises(RuntimeError, match="negative"):
        ops.pad_gelu(x, gelu_table(), -1, 0)


def conv_stack() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 32, 3, 2, padding=1), nn.Conv2d(32, 32, 3, 2, padding=1),
                         nn.Conv2d(32, 16, 3, 2, padding=1)).to(torch.bfloat16)


@needs_ops
@pytest.mark.parametrize("make", [lambda m, o: CpuConvs(m, native.avx512_kernel(), o),
                                  lambda m, o: Int8Convs(m, native.int8_kernel(), o),
                                  lambda m, o: Int8Convs(m, None, o)], ids=["bf16", "int8", "int8-reference"])
def test_a_conv_of_gelu_is_the_same_with_and_without_the_native_pass(make) -> None:  # noqa: ANN001
    model = conv_stack()
    x = torch.randn(3, 1, 40, 30).to(torch.bfloat16)
    first = make(model, ops)(model[0], x)  # the first convolution itself differs: see the test below
    results = []
    for encoder_ops in (ops, None):
        convs = make(model, encoder_ops)
        results.append(convs.of_gelu(model[2], convs.of_gelu(model[1], first)))
    assert results[0].shape == (3, 16, 5, 4) and torch.equal(results[0], results[1])


@needs_ops
@pytest.mark.parametrize("make", [lambda m, o: CpuConvs(m, native.avx512_kernel(), o),
                                  lambda m, o: Int8Convs(m, native.int8_kernel(), o)], ids=["bf16", "int8"])
def test_the_first_convolution_runs_natively_within_a_bf16_step_of_onednn(make) -> None:  # noqa: ANN001
    """One input channel: float32 sums rounded once, written channels-last; an image alone gets its batch bits."""
    model = conv_stack()
    x = (torch.randn(5, 1, 40, 30) * 3).to(torch.bfloat16)
    native_convs, onednn = make(model, ops), make(model, None)
    assert model[0] in native_convs.others.one_channel and model[0] not in onednn.others.one_channel
    got, want = native_convs(model[0], x), onednn(model[0], x)
    assert got.shape == want.shape == (5, 32, 20, 15)
    assert got.permute(0, 2, 3, 1).is_contiguous()  # channels-last memory, as the next convolution reads it
    ref = F.conv2d(x.float(), model[0].weight.float(), model[0].bias.float(), 2, 1)
    step = ref.abs() * 2.0 ** -7
    assert bool(((got.float() - ref).abs() <= step).all()) and bool(((want.float() - ref).abs() <= step).all())
    assert torch.equal(native_convs(model[0], x[2:3]), got[2:3])


@needs_ops
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_prepare_plugs_the_pass_into_the_kernels(ck_bf16, quantize) -> None:  # noqa: ANN001
    prepared = prepare_cpu(ck_bf16.model, use_native=True, quantize=quantize)
    assert prepared.kernels.conv_gelu is not None
    assert "native first conv; GELU and padding between convs in one pass" in prepared.description


# --- the self-test: a correct module written in torch passes, broken ones are refused ---------------------------

def torch_pad_gelu(x: torch.Tensor, table: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    return F.pad(F.gelu(x.contiguous()), (0, 0, pw, pw, ph, ph))


def torch_conv_one_channel(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, kh: int, kw: int,
                           sh: int, sw: int, ph: int, pw: int) -> torch.Tensor:
    """float32 sums per output, elementwise over the batch (so an image alone gets its bits in a batch)."""
    xp = F.pad(x.float()[:, 0], (pw, pw, ph, ph))
    ho, wo = (xp.shape[1] - kh) // sh + 1, (xp.shape[2] - kw) // sw + 1
    acc = torch.zeros(x.shape[0], ho, wo, taps.shape[1]) + (0 if bias is None else bias)
    for ky in range(kh):
        for kx in range(kw):
            patch = xp[:, ky:ky + sh * (ho - 1) + 1:sh, kx:kx + sw * (wo - 1) + 1:sw]
            acc = acc + patch[..., None] * taps[ky * kw + kx]
    return acc.to(torch.bfloat16)


def fake_ops(pad_gelu=torch_pad_gelu, conv_one_channel=torch_conv_one_channel) -> ModuleType:  # noqa: ANN001
    mod = ModuleType("fake_encoder_ops")
    mod.pad_gelu, mod.conv_one_channel = pad_gelu, conv_one_channel
    return mod


def test_a_correct_torch_module_passes_the_self_test() -> None:
    selftest.check_encoder_ops(fake_ops())  # the check demands what is right, not what our kernel happens to do


def gelu_of_the_layout_given(x, table, ph, pw):  # noqa: ANN001, ANN201 - torch's GELU on a channels-first view
    return F.pad(F.gelu(x), (0, 0, pw, pw, ph, ph))


def border_of_ones(x, table, ph, pw):  # noqa: ANN001, ANN201
    return F.pad(F.gelu(x.contiguous()), (0, 0, pw, pw, ph, ph), value=1.0)


def without_bias(x, taps, bias, *geometry):  # noqa: ANN001, ANN002, ANN201
    return torch_conv_one_channel(x, taps, None, *geometry)


@pytest.mark.parametrize(("broken", "message"), [
    (fake_ops(pad_gelu=gelu_of_the_layout_given), "pad_gelu"),
    (fake_ops(pad_gelu=border_of_ones), "pad_gelu"),
    (fake_ops(conv_one_channel=without_bias), "conv_one_channel"),
], ids=["non-contiguous-gelu", "border", "conv-bias"])
def test_a_broken_module_is_refused_with_one_warning(broken, message, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert selftest.verified("encoder ops", broken, selftest.check_encoder_ops) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "encoder ops" in warnings[0] and message in warnings[0], warnings
