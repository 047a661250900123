"""The native kernels' self-tests: they pass on this machine's kernels, they reject kernels that give wrong
or batch-dependent numbers (one warning, kernel None), and the loader picks AMX, then AVX512-BF16."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qasr.engine.cpu import native, selftest
from qasr.engine.cpu.int8 import patch_rows


@pytest.fixture
def fresh() -> Iterator[None]:
    """Kernel choices made afresh in the test, and forgotten after it (before monkeypatch undoes its patches)."""
    native.clear_caches()
    yield
    native.clear_caches()


# --- a correct GEMM module written in plain torch, and ways to break it ---------------------------------------

def exact_linear(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 products summed per element (so every row is computed the same way whatever M is)."""
    out = (x.float()[:, None, :] * w.float()[None, :n, :]).sum(-1)
    return (out if bias is None else out + bias).to(torch.bfloat16)


def exact_conv(xp: torch.Tensor, w: torch.Tensor, cout: int, bias: torch.Tensor | None, kh: int, kw: int, sh: int,
               sw: int, linear: Callable = exact_linear) -> torch.Tensor:
    return linear(patch_rows(xp, kh, kw, sh, sw), w, cout, bias)  # patches as rows, (kh, kw, cin) order


def torch_gemm(linear: Callable = exact_linear, conv: Callable = exact_conv) -> ModuleType:
    mod = ModuleType("fake_gemm")
    mod.supported = lambda: True
    mod.pack = lambda w: w.contiguous()  # the "packed" weight is the weight
    mod.linear = linear
    mod.conv = conv
    return mod


def truncating_when_small(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Right for a 37-row call; a call of <= 5 rows rounds toward zero instead: batch-dependent rows."""
    if x.shape[0] > 5:
        return exact_linear(x, w, n, bias)
    out = (x.float()[:, None, :] * w.float()[None, :n, :]).sum(-1) + (0 if bias is None else bias)
    return (out.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def dropping_k_tail(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Loses the last K % 32 values, as a kernel with a broken tail tile would."""
    k = x.shape[1] // 32 * 32 or x.shape[1]
    return exact_linear(x[:, :k], w[:, :k], n, bias)


def losing_last_column(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = exact_linear(x, w, n, bias)
    out[:, -1] = 0
    return out


def raising(*args: object) -> torch.Tensor:
    raise RuntimeError("illegal instruction in a tile load")


def without_conv_bias(xp: torch.Tensor, w: torch.Tensor, cout: int, bias: torch.Tensor | None, *shape: int):  # noqa: ANN201
    return exact_conv(xp, w, cout, None, *shape)


def test_a_correct_torch_kernel_passes() -> None:
    selftest.check_gemm(torch_gemm())  # the checks demand what is right, not what our kernels happen to do


@pytest.mark.parametrize(("broken", "message"), [
    (torch_gemm(linear=truncating_when_small), "alone differ"),
    (torch_gemm(linear=dropping_k_tail), "linear K=70"),
    (torch_gemm(linear=losing_last_column), "values off"),
    (torch_gemm(linear=raising), "illegal instruction"),
    (torch_gemm(conv=without_conv_bias), "conv"),
], ids=["batch-dependent", "lost-k-tail", "lost-column", "raises", "conv-bias"])
def test_a_broken_kernel_is_rejected_with_one_warning(broken: ModuleType, message: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert selftest.verified("broken GEMM", broken, selftest.check_gemm) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "broken GEMM" in warnings[0].getMessage() and message in warnings[0].getMessage()


def test_the_machines_kernels_pass_their_self_tests_quickly(fresh: None) -> None:
    if native._build("qasr_decoder_ops", "decoder_ops.cpp") is None:
        pytest.skip("no compiler for the native kernels (or QASR_NO_NATIVE=1)")
    assert native.decode_kernel() is not None
    assert native.decoder_ops_kernel() is not None
    assert native.encoder_ops_kernel() is not None
    names = ["decode attention", "decoder ops", "encoder ops"]
    if native._bf16_module() is not None:  # an AVX512-BF16 CPU
        assert native.avx512_kernel() is not None and native.attention_kernel() is not None
        names += ["AVX512-BF16 linear", "AVX512-BF16 prefill attention"]
    if native.amx_kernel() is not None:
        names.append("AMX-BF16 linear")
    for name in names:
        assert selftest.timings[name] < 1.0, (name, selftest.timings[name])


def test_a_broken_build_gives_no_kernel_and_one_warning_each(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    broken = torch_gemm(linear=losing_last_column)
    broken.prefill_attention = lambda q, *args: torch.zeros_like(q)
    real_build = native._build
    bf16_modules = ("qasr_bf16_linear", "qasr_prefill_attention")
    monkeypatch.setattr(native, "_build",
                        lambda name, *a: broken if name in bf16_modules else real_build(name, *a))
    monkeypatch.setattr(native, "cpu_flags", lambda: native.AVX512_BF16_CPU)  # no AMX to fall back on
    with caplog.at_level(logging.WARNING, logger="qasr"):
        assert native.linear_kernel() is None
        assert native.attention_kernel() is None
        assert native.avx512_kernel() is None  # asked again: cached, no second warning
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 2, messages
    assert "AVX512-BF16 linear" in messages[0] and "AVX512-BF16 prefill attention" in messages[1]


def emulated_amx() -> ModuleType | None:
    tests = str(Path(__file__).resolve().parents[2])  # tests/, where amx_emulate.h lives
    mod = native._build("qasr_amx_linear_emulated", "amx_linear.cpp", ("-DQASR_AMX_EMULATE",), (tests,))
    return mod if mod is not None and mod.supported() else None


def test_amx_is_preferred_and_qasr_no_amx_turns_it_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU that reports AMX (here: the scalar-emulated AMX kernel standing in for the hardware one)."""
    avx512, amx = native._bf16_module(), emulated_amx()
    if avx512 is None or amx is None:
        pytest.skip("needs the AVX512-BF16 kernel and the emulated AMX build (compiler, AVX512-BF16 CPU)")
    real_build = native._build
    # this CPU's own flags plus AMX: the AVX512-BF16 kernel must stay buildable after clear_caches() below
    flags = native.cpu_flags() | {"amx_bf16", "amx_tile"}
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(native, "_build", lambda name, *a: amx if name == "qasr_amx_linear" else real_build(name, *a))
    monkeypatch.delenv("QASR_NO_AMX", raising=False)
    chosen = native.linear_kernel()
    assert native.amx_kernel() is amx
    assert chosen is amx
    assert native.attention_kernel() is not None
    monkeypatch.setenv("QASR_NO_AMX", "1")
    native.clear_caches()
    assert native.amx_kernel() is None
    assert native.linear_kernel() is avx512


def test_qasr_no_native_turns_every_kernel_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QASR_NO_NATIVE", "1")
    native.clear_caches()
    kernels = (native.linear_kernel, native.amx_kernel, native.avx512_kernel, native.attention_kernel,
               native.decode_kernel, native.decoder_ops_kernel, native.encoder_ops_kernel)
    assert all(k() is None for k in kernels)
