"""quantize="int8": the quantization arithmetic, the int8 linears and convs, the engine against a plain PyTorch
int8 reference (same quantization, no engine), batch invariance, and the option in the API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEMO, greedy_without_engine, int8_unfold_conv, noise, prompt_for
from torch import nn

from qasr import TranscribeOptions
from qasr.engine.config import EngineConfig
from qasr.engine.cpu.int8 import Int8Convs, int8_linear_reference, patch_rows, quantize_weight
from qasr.engine.cpu.int8 import quantize_rows_reference as quantize_rows  # the tests' short name
from qasr.engine.cpu.native import decode_kernel
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.engine.cpu.quantized_linears import int8_linears
from qasr.engine.engine import Engine, RequestSpec
from qasr.model.kernels import Kernels
from qasr.outputs.writers import score

ROOT = Path(__file__).resolve().parents[3]
KV = 64 << 20
WAIT_S = 120


def rows_with_edge_cases(dtype: torch.dtype, n: int = 7, k: int = 13, seed: int = 0) -> torch.Tensor:
    """Random rows (odd sizes) plus a zero row, an all-equal positive row and an all-equal negative row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]
    x[1] = 0
    x[2] = 0.37
    x[3] = -5.0
    return x.to(dtype)


# --------------------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_quantization_round_trip(dtype) -> None:
    w = rows_with_edge_cases(dtype)
    w_q, scale = quantize_weight(w)
    assert w_q.dtype == torch.int8 and w_q.shape == w.shape and scale.dtype == torch.float32
    wf = w.float()
    err = (w_q.double() * scale.double()[:, None] - wf.double()).abs()
    # round to nearest: at most half a step, and a hair (the float32 scale is off by half an ulp, which 127
    # steps multiply by 127, and the quotient is rounded too)
    assert (err <= scale.double()[:, None] / 2 * (1 + 2e-5)).all()
    assert (w_q.abs() <= 127).all()
    assert (w_q[1] == 0).all() and scale[1] == 1.0  # a zero row: zeros, a finite scale
    assert (w_q[2] == 127).all() and (w_q[3] == -127).all()  # an all-equal row sits at the end of the range
    nonzero = [0, 2, 3, 4, 5, 6]
    assert (w_q[nonzero].abs().amax(1) == 127).all()  # each row uses its whole range
    amax = wf.abs().amax(1)
    assert torch.equal(scale, torch.where(amax > 0, amax / 127, torch.ones_like(amax)))


def test_weight_blocks_change_nothing(monkeypatch) -> None:
    from qasr.engine.cpu import int8

    w = rows_with_edge_cases(torch.bfloat16, n=9, k=13)
    whole = quantize_weight(w)
    monkeypatch.setattr(int8, "WEIGHT_BLOCK", 30)  # two rows per block, the last one alone
    blocked = quantize_weight(w)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_quantization_round_trip_and_independence(dtype) -> None:
    x = rows_with_edge_cases(dtype, seed=1)
    x_q, scale = quantize_rows(x)
    assert x_q.dtype == torch.int8 and scale.dtype == torch.float32
    err = (x_q.double() * scale.double()[:, None] - x.double()).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 2e-5)).all()
    assert (x_q[1] == 0).all() and scale[1] == 0  # a zero row: zeros and scale 0, no NaN
    assert (x_q[2] == 127).all() and (x_q[3] == -127).all()
    # one float32 multiply by 127 / amax, then round half to even (not a division by the scale)
    xf = x.float().numpy()
    amax = np.abs(xf).max(1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    want = np.clip(np.rint(xf * inv[:, None]), -127, 127)
    np.testing.assert_array_equal(x_q.numpy(), want)
    for i in range(x.shape[0]):  # a row's quantization is its own
        q1, s1 = quantize_rows(x[i:i + 1])
        assert torch.equal(q1[0], x_q[i]) and torch.equal(s1[0], scale[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_reference_is_the_quantized_product(dtype, bias) -> None:
    g = torch.Generator().manual_seed(3)
    m, k, n = 9, 37, 11  # odd sizes throughout
    x = rows_with_edge_cases(dtype, m, k, seed=4)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    w_q, w_scale = quantize_weight(w)
    y = int8_linear_reference(x, w_q, w_scale, b)
    assert y.dtype == dtype and y.shape == (m, n)
    x_q, a_scale = quantize_rows(x)
    acc = x_q.double() @ w_q.double().T  # exact in float64 (|acc| < 2^53)
    # the epilogue in numpy float32, step by step in the arithmetic's order
    s = a_scale.numpy()[:, None] * w_scale.numpy()[None, :]
    want = acc.numpy().astype(np.float32) * s
    if b is not None:
        want = want + b.float().numpy()[None, :]
    assert torch.equal(y, torch.from_numpy(want).to(dtype))
    # and close to the float64 value of the same quantized product (one float32 and one output rounding)
    exact = acc * a_scale.double()[:, None] * w_scale.double()[None, :] + (0 if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=1e-6)
    assert torch.equal(y[1], (torch.zeros(n) if b is None else b.float()).to(dtype))  # a zero row: the bias only
    for i in (0, 4, m - 1):  # a row alone: the same bits as in the batch
        assert torch.equal(int8_linear_reference(x[i:i + 1], w_q, w_scale, b)[0], y[i])


def fake_kernel(calls: dict) -> types.ModuleType:
    """A stand-in for a native int8 module (pack/linear), computing the reference; it records its calls."""
    mod = types.ModuleType("fake_int8")
    mod.KIND = "fake"

    def pack(w_q: torch.Tensor) -> torch.Tensor:
        assert w_q.dtype == torch.int8 and w_q.is_contiguous()
        calls["pack"] += 1
        return w_q.clone()

    def linear(x, packed, n, w_scale, bias):  # noqa: ANN001, ANN202
        assert x.dim() == 2 and x.is_contiguous() and packed.shape[0] == n == w_scale.shape[0]
        assert bias is None or bias.dtype == torch.float32
        calls["linear"] += 1
        return int8_linear_reference(x, packed, w_scale, bias)

    def conv(xp, packed, n, w_scale, bias, kh, kw, sh, sw):  # noqa: ANN001, ANN202
        assert xp.dim() == 4 and xp.is_contiguous() and packed.shape == (n, kh * kw * xp.shape[3])
        calls["conv"] += 1
        return int8_linear_reference(patch_rows(xp, kh, kw, sh, sw), packed, w_scale, bias)

    mod.pack, mod.linear, mod.conv = pack, linear, conv
    return mod


def test_int8_linears_cover_every_linear_with_or_without_a_kernel() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 5, bias=False), nn.Linear(1, 3))
    calls = {"pack": 0, "linear": 0, "conv": 0}
    plain, native = int8_linears(model), int8_linears(model, fake_kernel(calls))
    assert calls["pack"] == 3
    for layer, x in ((model[0], torch.randn(2, 3, 13)), (model[1], torch.randn(1, 7)), (model[2], torch.randn(4, 1)),
                     (model[0], torch.randn(0, 13))):
        want = int8_linear_reference(x.reshape(-1, x.shape[-1]), *quantize_weight(layer.weight), layer.bias)
        for linears in (plain, native):
            out = linears(layer, x)
            assert out.shape == (*x.shape[:-1], layer.out_features)
            assert torch.equal(out.reshape(-1, layer.out_features), want)
    assert calls["linear"] == 4  # the empty call too: the native modules answer it with a (0, N) result
    with pytest.raises(KeyError):
        plain(nn.Linear(13, 7), torch.randn(1, 13))  # never a silent float product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_convs_match_an_unfold_reference_and_keep_the_first_conv_in_float(dtype) -> None:
    torch.manual_seed(1)
    first = nn.Conv2d(1, 3, 3, 2, padding=1).to(dtype)
    odd = nn.Conv2d(3, 5, 3, 2, padding=1).to(dtype)  # odd channels, odd spatial sizes
    model = nn.Sequential(first, odd)
    calls = {"pack": 0, "linear": 0, "conv": 0}
    for convs in (Int8Convs(model), Int8Convs(model, fake_kernel(calls))):
        x1 = torch.randn(3, 1, 11, 9).to(dtype)
        assert torch.equal(convs(first, x1), F.conv2d(x1, first.weight, first.bias, 2, 1))  # float, same maths
        x = torch.randn(3, 3, 7, 9).to(dtype)
        out = convs(odd, x)
        assert out.shape == (3, 5, 4, 5) and out.dtype == dtype
        assert torch.equal(out, int8_unfold_conv(odd, x))  # the feature order does not matter: rows are exact
        assert torch.equal(convs(odd, x[1:2]), out[1:2])  # an image alone: the same bits
    # the module reads the patches in place (its conv), never an explicit im2col; the first conv never reaches it
    assert calls == {"pack": 1, "linear": 0, "conv": 2}


# ------------------------------------------------------------------------------ the engine vs a reference
def reference_kernels() -> Kernels:
    """The quantized model in plain PyTorch: every linear quantized from scratch at each call, the convs with
    more than one input channel by unfold (the first one in float, as the engine keeps it)."""

    def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear_reference(x.reshape(-1, x.shape[-1]), *quantize_weight(module.weight), module.bias)
        return y.view(*x.shape[:-1], -1)

    def conv(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return module(x) if module.in_channels == 1 else int8_unfold_conv(module, x)

    return Kernels(linear=linear, conv=conv)


def reference_greedy(ck, wave: np.ndarray, new_tokens: int) -> list[int]:  # noqa: ANN001 - a Checkpoint
    return greedy_without_engine(ck, wave, new_tokens, reference_kernels())


def generate(ck, waves: list[np.ndarray], new_tokens: int = 10, **config) -> list:  # noqa: ANN001, ANN003
    with Engine(ck, EngineConfig(**{"kv_cache_bytes": KV, "quantize": "int8", **config})) as engine:
        assert "int8" in engine.prepared.description
        futures = [engine.submit(RequestSpec(prompt_for(ck, w), new_tokens, waveform=w, ignore_eos=True))
                   for w in waves]
        return [f.result(WAIT_S) for f in futures]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_a_plain_int8_reference(dtype, request) -> None:
    """The engine's int8 model is the reference's. Torch ops around the products on both sides: the native
    fused norms and attention round bf16 otherwise than torch, and a quantized activation turns such a
    last-bit difference into a whole int8 step now and then (here: the tenth bf16 token differed)."""
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    waves = [noise(s, seed=20 + k) for k, s in enumerate((0.9, 4.3))]
    got = [r.token_ids for r in generate(ck, waves, native_kernels=False)]
    want = [reference_greedy(ck, w, 10) for w in waves]
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_alone_and_in_a_batch_gets_the_same_tokens(dtype, request) -> None:
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    waves = [noise(s, seed=40 + k) for k, s in enumerate((0.5, 2.2, 6.1, 1.3, 9.7))]
    together = generate(ck, waves, new_tokens=12)
    # the int8 products are exact, so their bits are a row's own; the very same log-probabilities need the
    # native decode attention too (the portable one, a masked SDPA over the padded batch, rounds by batch)
    same_bits = decode_kernel() is not None
    for wave, batched in zip(waves, together, strict=True):
        alone = generate(ck, [wave], new_tokens=12, max_running=1)[0]
        assert alone.token_ids == batched.token_ids
        assert alone.logprobs == batched.logprobs or not same_bits


def test_prepare_names_the_path_and_plugs_in_a_module(ck) -> None:
    calls = {"pack": 0, "linear": 0, "conv": 0}
    prepared = prepare_cpu(ck.model, use_native=False, quantize="int8", int8_kernel=fake_kernel(calls))
    assert "int8" in prepared.description and "native fake" in prepared.description
    n_linear = sum(isinstance(m, nn.Linear) for m in ck.model.modules())
    n_conv = sum(isinstance(m, nn.Conv2d) and m.in_channels > 1 for m in ck.model.modules())
    layers = len(ck.model.model.layers)  # each packs its q/k/v as one weight and its gate/up as one
    assert calls["pack"] == n_linear - 3 * layers + n_conv
    plain = prepare_cpu(ck.model, use_native=False, quantize="int8")
    assert "torch reference" in plain.description and plain.kernels.linear.kind == "int8"


# ------------------------------------------------------------------------------------------- the option
def test_the_option_through_asr_from_pretrained(tiny_original) -> None:
    from qasr import ASR

    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="float32", quantize="int8",
                              engine=EngineConfig(kv_cache_bytes=KV, max_running=3))
    try:
        assert asr._core.engine.prepared.kernels.linear.kind == "int8"
        assert isinstance(asr._core.engine.prepared.kernels.conv, Int8Convs)
        assert asr._core.engine.config.max_running == 3  # the other engine settings are kept
        assert asr.transcribe(noise(1.5), TranscribeOptions(sample_rate=16000))[0].error is None
    finally:
        asr.close()
    off = ASR.from_pretrained(tiny_original, device="cpu", dtype="float32", quantize="none")
    try:
        assert "int8" not in off._core.engine.prepared.description
    finally:
        off.close()


def test_unsupported_values_are_clear_errors(tiny_original, ck) -> None:
    from qasr import ASR

    with pytest.raises(ValueError, match="unknown quantize mode 'int2'"):
        ASR.from_pretrained(tiny_original, device="cpu", quantize="int2")
    with pytest.raises(ValueError, match="quantize must be None"):
        EngineConfig(quantize="fp8")
    for mode in ("int8", "int4"):  # the CUDA backend has no int8 or int4 kernels
        with pytest.raises(ValueError, match=f"CPU backend only \\(no cuda {mode} kernels"):
            Engine(ck, EngineConfig(kv_cache_bytes=KV, quantize=mode, backend="cuda"))


def test_cli_transcribes_with_int8(demo) -> None:
    """A real ``qasr transcribe --quantize int8``: the right text, and the int8 model's own confidence (the
    float model's differs), so the option reached the engine."""
    from qasr import ASR

    clip = ROOT / "examples" / "alarm.flac"
    out = subprocess.run([sys.executable, "-m", "qasr", "transcribe", str(clip), "-m", str(DEMO), "--device", "cpu",
                          "--dtype", "float32", "--quantize", "int8", "-f", "json"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert line["text"] == "set an alarm for seven thirty tomorrow"
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32", quantize="int8")
    try:
        int8 = asr.transcribe(clip)[0]
    finally:
        asr.close()
    floats = demo.transcribe(clip)[0]
    # the int8 and float models say the same words with confidences about 3e-4 apart (json keeps 4 decimals)
    assert abs(int8.segments[0].avg_logprob - floats.segments[0].avg_logprob) > 1e-4
    got = line["segments"][0]["avg_logprob"]
    assert got == score(int8.segments[0].avg_logprob) != score(floats.segments[0].avg_logprob)
    bad = subprocess.run([sys.executable, "-m", "qasr", "transcribe", str(clip), "--quantize", "int2"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "invalid choice: 'int2'" in bad.stderr


def test_bench_runs_an_int8_side_and_its_last_line_names_it(tiny_original) -> None:
    from qasr.bench.common import make_clip
    from qasr.bench.cpu import Workload, measure_decode_batch1, run_qasr, summary_line
    from qasr.bench.main import main as bench_main

    clips = [make_clip(s, k) for k, s in enumerate((1.5, 2.5))]
    side = run_qasr(tiny_original, clips, Workload((), ((1, 1),), (1.0, 1.5)), kv_gib=0.05, seed=0, quantize="int8")
    assert "int8" in side["kernels"] and side["tokens"] > 0
    # the batch-1 decode figure: both settings in one process, runs interleaved, token arrivals timed
    b1 = measure_decode_batch1(tiny_original, (None, "int8"), rounds=2)
    assert set(b1) == {"none", "int8"}
    for side in b1.values():
        assert side["tokens"] == 65 and len(side["runs_ms"]) == 2 and side["ms_per_token"] > 0
        assert min(side["runs_ms"]) <= side["ms_per_token"] <= max(side["runs_ms"])
    report = dict(speedup=3.0, qasr=dict(rtfx=10.0), efficiency=dict(overall=0.25), qasr_int8=dict(rtfx=5.0),
                  int8=dict(speedup=1.5, int8_over_bf16=0.5, efficiency=dict(overall=0.125)))
    assert summary_line(report) == "speedup=1.50 rtfx=5.0 efficiency=0.125 int8_over_bf16=0.50"
    with pytest.raises(SystemExit):  # the GPU mode has no int8 side: refused, not ignored
        bench_main(["--device", "cuda", "--quantize", "int8"])


def test_serve_and_ray_workers_take_the_option(tiny_original) -> None:
    from qasr.cli.main import build_parser
    from qasr.distributed.config import EngineSpec

    parser = build_parser()
    assert parser.parse_args(["serve", "--quantize", "int8"]).quantize == "int8"
    assert parser.parse_args(["serve"]).quantize == "none"
    asr = EngineSpec(str(tiny_original), device="cpu", dtype="float32", quantize="int8").load()
    try:
        assert asr._core.engine.prepared.kernels.linear.kind == "int8"
    finally:
        asr.close()


def test_the_engine_reference_gives_the_native_kernels_bits() -> None:
    """The torch path of the engine (int8.py) and the native module compute the same bits, so a machine with
    the kernel and one without give the same transcripts (random bf16 rows, odd shapes, a bias)."""
    from qasr.engine.cpu import native
    from qasr.engine.cpu.int8 import quantize_weight

    kernel = native.int8_kernel()
    if kernel is None:
        pytest.skip("no native int8 kernel on this CPU")
    gen = torch.Generator().manual_seed(5)
    for m, k, n in ((1, 1024, 300), (17, 65, 33), (300, 1000, 17)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        w_q, w_scale = quantize_weight(torch.randn(n, k, generator=gen))
        bias = torch.randn(n, generator=gen)
        want = int8_linear_reference(x, w_q, w_scale, bias)
        got = kernel.linear(x, kernel.pack(w_q), n, w_scale, bias)
        assert torch.equal(got, want), (m, k, n, (got.float() - want.float()).abs().max())
