"""quantize="int4": the group-wise weight quantization, the W4A8 product (torch reference and the native
AVX512-VNNI kernel, bit for bit, on odd shapes), which layers go int4 and which int8, the engine against a
plain PyTorch reference of the same quantized model, batch invariance, the self-test, and the option."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import greedy_without_engine, int8_unfold_conv, noise, prompt_for
from torch import nn

from qasr import TranscribeOptions
from qasr.engine.config import EngineConfig
from qasr.engine.cpu import native, selftest
from qasr.engine.cpu.int4 import GROUP, Int4Weight, int4_linear_reference, quantize_weight_groups
from qasr.engine.cpu.int8 import Int8Convs, Int8Weight, int8_linear_reference, quantize_rows_reference, quantize_weight
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.engine.cpu.quantized_linears import int4_decoder_linears, same_input_groups
from qasr.engine.engine import Engine, RequestSpec
from qasr.model.kernels import Kernels

KV = 64 << 20
WAIT_S = 120


def int4_kernel():  # noqa: ANN201 - a module
    kernel = native.int4_kernel()
    if kernel is None:
        pytest.skip("no native int4 kernel on this CPU (it needs AVX512-VNNI)")
    return kernel


# --------------------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("k", [1, 13, 128, 300])
def test_group_quantization_round_trip(k) -> None:
    g = torch.Generator().manual_seed(k)
    w = torch.randn(6, k, generator=g) * torch.logspace(-3, 1, 6)[:, None]
    w[1] = 0
    w_q, scale = quantize_weight_groups(w.bfloat16())
    groups = -(-k // GROUP)
    assert w_q.dtype == torch.int8 and w_q.shape == (6, k) and scale.shape == (6, groups)
    assert (w_q.abs() <= 7).all()
    wf = w.bfloat16().float()
    per_col = scale.repeat_interleave(GROUP, dim=1)[:, :k].double()
    err = (w_q.double() * per_col - wf.double()).abs()
    assert (err <= per_col / 2 * (1 + 1e-5)).all()  # round to nearest: half a step, and a hair
    assert (w_q[1] == 0).all() and (scale[1] == 1.0).all()  # a zero row: zeros, finite scales
    for gi in range(groups):  # each group has its own scale and uses its whole range
        cols = slice(gi * GROUP, min((gi + 1) * GROUP, k))
        amax = wf[:, cols].abs().amax(1)
        assert torch.equal(scale[:, gi], torch.where(amax > 0, amax / 7, torch.ones_like(amax)))
        assert (w_q[[0, 2, 3, 4, 5], cols].abs().amax(1) == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_the_group_wise_quantized_product(dtype, bias) -> None:
    """The reference against the spec written out in float64 from the integer sums (exact there), per group."""
    g = torch.Generator().manual_seed(3)
    m, k, n = 5, 300, 9
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    x[2] = 0
    w_q, scale = quantize_weight_groups(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    got = int4_linear_reference(x, w_q, scale, b)
    q, a_scale = quantize_rows_reference(x)
    want = torch.zeros(m, n, dtype=torch.float32)
    for gi in range(scale.shape[1]):
        cols = slice(gi * GROUP, (gi + 1) * GROUP)
        acc = q[:, cols].long() @ w_q[:, cols].long().T  # exact
        want = want + (acc.float() * scale[:, gi])  # float32: one rounding per op, as specified
    want = want * a_scale[:, None]
    if b is not None:
        want = want + b
    assert torch.equal(got, want.to(dtype))
    assert torch.equal(got[2], torch.zeros(n, dtype=dtype) + (b.to(dtype) if b is not None else 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_equals_the_reference_on_odd_shapes_and_rows_never_depend_on_the_batch(dtype) -> None:
    kernel = int4_kernel()
    g = torch.Generator().manual_seed(11)
    for k, n in ((1, 5), (3, 64), (129, 67), (200, 130), (1000, 300)):
        w_q, scale = quantize_weight_groups(torch.randn(n, k, generator=g))
        bias = torch.randn(n, generator=g) if n % 2 else None
        packed = kernel.pack(w_q, scale)
        x = (torch.randn(300, k, generator=g) * torch.exp(4 * torch.rand(300, 1, generator=g) - 2)).to(dtype)
        full = kernel.linear(x, packed, n, bias)
        assert torch.equal(full, int4_linear_reference(x, w_q, scale, bias)), (k, n)
        for m in (1, 2, 17):  # M = 1, 2, 17 at odd offsets: every pass width and tail
            rows = slice(113, 113 + m)
            assert torch.equal(kernel.linear(x[rows], packed, n, bias), full[rows]), (k, n, m)
        assert kernel.linear(x[:0], packed, n, bias).shape == (0, n)


def test_native_kernel_refuses_what_it_cannot_hold() -> None:
    kernel = int4_kernel()
    with pytest.raises(RuntimeError, match=r"\[-7, 7\]"):
        kernel.pack(torch.full((2, 8), 8, dtype=torch.int8), torch.ones(2, 1))
    packed = kernel.pack(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="the call wants"):
        kernel.linear(torch.randn(1, 16), packed, 4)


def test_self_test_passes_the_kernel_and_disables_a_wrong_one(caplog) -> None:
    kernel = int4_kernel()
    assert selftest.verified("int4", kernel, selftest.check_int4_gemm) is kernel

    class OffByOne:  # the real kernel with one output value wrong
        pack = staticmethod(kernel.pack)

        @staticmethod
        def linear(x, packed, n, bias=None):  # noqa: ANN001, ANN205
            y = kernel.linear(x, packed, n, bias)
            y.view(-1)[-1] += 1
            return y

    assert selftest.verified("broken int4", OffByOne, selftest.check_int4_gemm) is None
    assert "broken int4" in caplog.text and "differ from the reference" in caplog.text


# --------------------------------------------------------------------------------- which layers, which path
def test_decoder_and_lm_head_go_int4_and_the_encoder_int8(ck) -> None:
    linears = int4_decoder_linears(ck.model)
    decoder = [m for m in ck.model.model.modules() if isinstance(m, nn.Linear)] + [ck.model.lm_head]
    for module, product in linears.products.items():
        assert isinstance(product.weight, Int4Weight if any(module is m for m in decoder) else Int8Weight)
    assert len(linears.products) == sum(isinstance(m, nn.Linear) for m in ck.model.modules())
    assert sum(isinstance(p.weight, Int4Weight) for p in linears.products.values()) == len(decoder)
    with pytest.raises(KeyError):
        linears(nn.Linear(4, 4), torch.randn(1, 4))  # never a silent float product


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_same_input_linears_as_one_product_give_each_modules_bits(ck_bf16, mode) -> None:
    """q/k/v and gate/up as one product over their concatenated weights, split by columns: the same bits as
    each module's own product (its columns depend only on the row's quantization and their own weights), on the
    torch reference and on the native kernels; a member called alone gets its slice; fewer weights packed."""
    from qasr.engine.cpu.quantized_linears import int8_linears

    model = ck_bf16.model
    groups = same_input_groups(model)
    assert len(groups) == 2 * len(model.model.layers)
    kernels = [(None, None)]
    if native.int4_kernel() is not None and native.int8_kernel() is not None:
        kernels.append((native.int8_kernel(), native.int4_kernel()))
    x = torch.randn(3, 5, model.cfg.decoder.hidden_size).bfloat16()
    for k8, k4 in kernels:
        make = (lambda g: int8_linears(model, k8, g)) if mode == "int8" else \
            (lambda g: int4_decoder_linears(model, k8, k4, g))  # noqa: B023
        fused, separate = make(groups), make(())
        assert len(fused.products) + len(fused.groups) < len(separate.products)
        for group in groups:
            together = fused.group(group, x)
            for module, out in zip(group, together, strict=True):
                assert out.shape == (3, 5, module.out_features)
                assert torch.equal(out, separate(module, x))
                assert torch.equal(fused(module, x), out)  # alone: its slice of the group's product


def test_prepare_names_both_paths_and_warns_on_the_slow_one(ck, caplog) -> None:
    plain = prepare_cpu(ck.model, use_native=False, quantize="int4")
    assert "runs on its torch reference here" in caplog.text
    assert "int4 W4A8 decoder linears and LM head" in plain.description
    assert "int8 W8A8 encoder" in plain.description and "torch reference" in plain.description
    assert plain.kernels.linear.kind == "int4" and isinstance(plain.kernels.conv, Int8Convs)


# ------------------------------------------------------------------------------ the engine vs a reference
def reference_kernels() -> Kernels:
    """The int4 model in plain PyTorch, quantized from scratch at every call: int4 for the decoder's linears
    and the LM head (the modules whose in_features are the decoder's), int8 for the rest; the encoder's
    convolutions with more than one input channel as int8 GEMMs over unfolded patches."""

    def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if getattr(module, "_int4", False):
            y = int4_linear_reference(rows, *quantize_weight_groups(module.weight), module.bias)
        else:
            y = int8_linear_reference(rows, *quantize_weight(module.weight), module.bias)
        return y.view(*x.shape[:-1], -1)

    def conv(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return module(x) if module.in_channels == 1 else int8_unfold_conv(module, x)

    return Kernels(linear=linear, conv=conv)


@pytest.fixture()
def marked(ck_bf16):  # noqa: ANN001, ANN201
    """The bf16 tiny checkpoint with its int4 layers marked for reference_kernels (unmarked afterwards)."""
    layers = [m for m in ck_bf16.model.model.modules() if isinstance(m, nn.Linear)] + [ck_bf16.model.lm_head]
    for m in layers:
        m._int4 = True
    yield ck_bf16
    for m in layers:
        del m._int4


def generate(ck, waves: list[np.ndarray], new_tokens: int = 10, **config) -> list:  # noqa: ANN001, ANN003
    with Engine(ck, EngineConfig(**{"kv_cache_bytes": KV, "quantize": "int4", **config})) as engine:
        assert "int4" in engine.prepared.description
        futures = [engine.submit(RequestSpec(prompt_for(ck, w), new_tokens, waveform=w, ignore_eos=True))
                   for w in waves]
        return [f.result(WAIT_S) for f in futures]


def test_engine_tokens_equal_a_plain_int4_reference(marked) -> None:
    waves = [noise(s, seed=20 + k) for k, s in enumerate((0.9, 4.3))]
    got = [r.token_ids for r in generate(marked, waves, native_kernels=False)]
    assert got == [greedy_without_engine(marked, w, 10, reference_kernels()) for w in waves]


def test_the_native_kernels_in_the_model_give_the_references_tokens(marked) -> None:
    """The same quantized model with the native int4 and int8 modules doing the products (torch for the rest):
    the same tokens as the plain reference, since every product is bit for bit the reference's."""
    int4_kernel()
    prepared = prepare_cpu(marked.model, use_native=False, quantize="int4", int8_kernel=native.int8_kernel(),
                           int4_kernel=native.int4_kernel())
    assert "native AVX512-VNNI int4" in prepared.description
    waves = [noise(s, seed=30 + k) for k, s in enumerate((1.7, 3.1))]
    reference = reference_kernels()
    for w in waves:
        assert greedy_without_engine(marked, w, 8, prepared.kernels) == greedy_without_engine(marked, w, 8, reference)


def test_a_request_alone_and_in_a_batch_gets_the_same_tokens(ck_bf16) -> None:
    waves = [noise(s, seed=40 + k) for k, s in enumerate((0.5, 2.2, 6.1, 1.3))]
    together = generate(ck_bf16, waves, new_tokens=12)
    for wave, batched in zip(waves, together, strict=True):
        alone = generate(ck_bf16, [wave], new_tokens=12, max_running=1)[0]
        assert alone.token_ids == batched.token_ids
        if native.decode_kernel() is not None:  # the portable attention rounds by batch (see test_int8_mode)
            assert alone.logprobs == batched.logprobs


# ------------------------------------------------------------------------------------------- the option
def test_the_option_through_asr_from_pretrained_and_a_bad_value(tiny_original) -> None:
    from qasr import ASR

    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="bfloat16", quantize="int4",
                              engine=EngineConfig(kv_cache_bytes=KV))
    try:
        assert asr._core.engine.prepared.kernels.linear.kind == "int4"
        assert asr.transcribe(noise(1.2, seed=3), TranscribeOptions(sample_rate=16000))[0].error is None
    finally:
        asr.close()
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(quantize="int2")
