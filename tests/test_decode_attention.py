"""The native decode-attention kernel against float32 attention, for the shapes the models use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qasr.engine.cpu.native import decode_kernel

kernel = decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler for the native kernel")


def reference(q, kpool, vpool, starts, lens, scale):
    outs = []
    for b in range(q.shape[0]):
        s, n = int(starts[b]), int(lens[b])
        k = kpool[:, s:s + n].float()[None]
        v = vpool[:, s:s + n].float()[None]
        o = F.scaled_dot_product_attention(q[b].float()[None, :, None], k, v, scale=scale, enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype"), [
    (16, 8, 128, torch.bfloat16),  # Qwen3-ASR 0.6B / 1.7B: the AVX-512 path
    (4, 4, 128, torch.bfloat16),
    (8, 2, 128, torch.bfloat16),
    (4, 2, 64, torch.bfloat16),  # other head sizes: the portable loop
    (4, 2, 32, torch.float32),
])
def test_matches_float32_attention(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    pool = 3000
    kpool = torch.randn(kv_heads, pool, dim, dtype=dtype)
    vpool = torch.randn(kv_heads, pool, dim, dtype=dtype)
    kpool[:, 2990:] = float("nan")  # memory outside every sequence's range must never be read
    lens = torch.tensor([1, 7, 130, 1000, 17])
    starts = torch.tensor([0, 5, 20, 1500, 2900])
    q = torch.randn(len(lens), heads, dim, dtype=dtype)
    scale = dim ** -0.5
    got = kernel.decode_attention(q, kpool, vpool, starts, lens, scale).float()
    want = reference(q, kpool, vpool, starts, lens, scale)
    assert torch.isfinite(got).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()
    # a row is computed alone: the same result in any batch
    for b in range(len(lens)):
        one = kernel.decode_attention(q[b:b + 1].contiguous(), kpool, vpool, starts[b:b + 1], lens[b:b + 1], scale)
        assert torch.equal(one[0], kernel.decode_attention(q, kpool, vpool, starts, lens, scale)[b])


def test_stores_new_keys_and_values_before_attending() -> None:
    torch.manual_seed(2)
    kv_heads, dim = 8, 128
    kpool = torch.randn(kv_heads, 500, dim, dtype=torch.bfloat16)
    vpool = torch.randn(kv_heads, 500, dim, dtype=torch.bfloat16)
    starts, lens = torch.tensor([0, 100, 300]), torch.tensor([5, 60, 1])
    q = torch.randn(3, 16, dim, dtype=torch.bfloat16)
    k_new = torch.randn(3, kv_heads, dim, dtype=torch.bfloat16)
    v_new = torch.randn(3, kv_heads, dim, dtype=torch.bfloat16)
    kref, vref = kpool.clone(), vpool.clone()
    last = starts + lens - 1
    kref[:, last], vref[:, last] = k_new.transpose(0, 1), v_new.transpose(0, 1)
    want = kernel.decode_attention(q, kref, vref, starts, lens, 0.1)
    got = kernel.decode_attention(q, kpool, vpool, starts, lens, 0.1, k_new, v_new)
    assert torch.equal(kpool, kref) and torch.equal(vpool, vref)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("start", "ctx", "n"),
                         [(0, 0, 5), (100, 0, 128), (300, 1400, 128), (7, 61, 67), (1000, 130, 1)])
def test_prefill_chunk_attention_matches_float32(start: int, ctx: int, n: int) -> None:
    from qasr.engine.cpu.native import attention_kernel

    flash = attention_kernel()
    if flash is None:
        pytest.skip("no AVX512-BF16")
    torch.manual_seed(4)
    kv_heads, heads, dim = 8, 16, 128
    kpool = torch.randn(kv_heads, 2000, dim, dtype=torch.bfloat16)
    vpool = torch.randn(kv_heads, 2000, dim, dtype=torch.bfloat16)
    kpool[:, start + ctx + n:] = float("nan")  # keys after the chunk must never be read
    vpool[:, start + ctx + n:] = float("nan")
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16)
    scale = dim ** -0.5
    got = flash.prefill_attention(q, kpool, vpool, start, ctx, scale).float()
    keys = kpool[:, start:start + ctx + n].float()[None]
    values = vpool[:, start:start + ctx + n].float()[None]
    causal = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n)[:, None])
    want = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values, attn_mask=causal,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1.5e-2, rtol=1e-2), (got - want).abs().max()
    # each query row is computed on its own: the first rows alone give the same bits
    if n > 3:
        head = flash.prefill_attention(q[:3].contiguous(), kpool, vpool, start, ctx, scale)
        assert torch.equal(head, flash.prefill_attention(q, kpool, vpool, start, ctx, scale)[:3])
