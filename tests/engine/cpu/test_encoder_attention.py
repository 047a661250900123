"""The audio encoder's windowed attention on qasr's kernel (encoder_attention.cpp): each window attends on its
own rows, no padding and no mask, with a row's result depending on its window alone; used for bf16
activations (float32 keeps torch's SDPA, the reference maths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import noise

from qasr.audio.features import LogMel
from qasr.engine.cpu import native
from qasr.engine.engine import Engine, EngineConfig
from qasr.model.checkpoint import load_checkpoint
from qasr.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def kernel():  # noqa: ANN201
    mod = native.encoder_attention_kernel()
    if mod is None:
        pytest.skip("the encoder attention kernel did not build here (no compiler): torch's SDPA runs instead")
    return mod


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([F.scaled_dot_product_attention(*(t[s:s + n].float().transpose(0, 1) for t in (q, k, v)))
                      .transpose(0, 1) for s, n in windows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 48])  # 64: the AVX-512 path (0.6B and 1.7B encoders); 48: the portable one
def test_the_kernel_is_attention_within_each_window(kernel, dtype, head_dim) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(head_dim)
    windows = [(0, 104), (104, 1), (105, 7), (112, 50), (162, 17)]
    rows = sum(n for _, n in windows)
    q, k, v = (torch.randn(rows, 3, head_dim, generator=gen).to(dtype) for _ in range(3))
    got = kernel.encoder_attention(q, k, v, torch.tensor(windows), head_dim ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), reference(q, k, v, windows), rtol=tol, atol=tol)
    for s, n in windows:  # each window alone: the same bits
        alone = kernel.encoder_attention(q[s:s + n], k[s:s + n], v[s:s + n], torch.tensor([[0, n]]), head_dim ** -0.5)
        assert torch.equal(alone, got[s:s + n])


def test_windows_outside_the_rows_are_refused(kernel) -> None:  # noqa: ANN001
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    for bad in ([[0, 11]], [[-1, 3]], [[4, 0]]):
        with pytest.raises(RuntimeError, match="window"):
            kernel.encoder_attention(q, q, q, torch.tensor(bad), 0.125)


@pytest.fixture(scope="module")
def engine64(tmp_path_factory, kernel):  # noqa: ANN001, ANN201
    """bf16 with the encoder's head_dim 64 (d_model 256, 4 heads): the engine's encoder runs the kernel."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("enc64"), seed=5, d_model=256, encoder_attention_heads=4,
                                encoder_ffn_dim=512)
    ck = load_checkpoint(path, device="cpu", dtype="bfloat16")
    eng = Engine(ck, EngineConfig(kv_cache_bytes=2**24))
    assert eng.prepared.kernels.encoder_attention is not None and "native encoder attention" in \
        eng.prepared.description
    yield eng
    eng.close()


def encode(eng: Engine, waves: list, attention: bool = True) -> list[torch.Tensor]:  # noqa: ANN001
    kernels = eng.prepared.kernels
    if not attention:
        from dataclasses import replace

        kernels = replace(kernels, encoder_attention=None)
    feats = [LogMel(eng.checkpoint.features)(w) for w in waves]
    with torch.inference_mode():
        return eng.prepared.model.audio_tower(feats, conv_batch=eng.core.runner.conv_batch, kernels=kernels)


def test_an_utterance_gets_the_same_rows_alone_and_packed(engine64) -> None:  # noqa: ANN001
    waves = [noise(s, seed=k) for k, s in enumerate((0.7, 9.3, 17.0, 3.2))]
    packed = encode(engine64, waves)
    for wave, rows in zip(waves, packed, strict=True):
        assert torch.equal(encode(engine64, [wave])[0], rows)


def test_the_kernel_gives_the_rows_of_torchs_attention_within_bf16_rounding(engine64) -> None:  # noqa: ANN001
    waves = [noise(s, seed=10 + k) for k, s in enumerate((2.5, 11.0))]
    for ours, torchs in zip(encode(engine64, waves), encode(engine64, waves, attention=False), strict=True):
        assert ours.shape == torchs.shape
        err = (ours.float() - torchs.float()).abs().max().item()
        assert err <= 0.05 * torchs.float().abs().max().item(), err


def test_float32_keeps_torchs_attention(tiny_asr) -> None:  # noqa: ANN001
    eng = tiny_asr._core.engine  # float32: the reference maths, as transformers computes it
    assert "native encoder attention" not in eng.prepared.description
