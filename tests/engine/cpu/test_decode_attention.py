"""The native attention kernels (decode, prefill chunk) against float32 attention, for the shapes the models use,
reading through block tables scattered over the pool (NaN in every row a sequence does not own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qasr.engine.cpu.native import decode_kernel

kernel = decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler for the native kernel")


BS = 16


def scattered_tables(lens: list[int], blocks: int, seed: int) -> tuple[list[list[int]], torch.Tensor]:
    """Block tables for sequences of these lengths, drawn out of order from a pool of ``blocks`` blocks,
    and their (B, widest) int64 tensor padded with block 0."""
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lens:
        k = -(-n // BS)
        tables.append(order[:k])
        order = order[k:]
    width = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables])


def rows(table: list[int], n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(table)[pos // BS] * BS + pos % BS


def nan_outside(pool: torch.Tensor, tables: list[list[int]], lens: list[int]) -> None:
    """NaN in every pool row no sequence owns (other blocks, the unused tail of last blocks)."""
    owned = torch.zeros(pool.shape[1], dtype=torch.bool)
    for t, n in zip(tables, lens, strict=True):
        owned[rows(t, n)] = True
    pool[:, ~owned] = float("nan")


def reference(q, kpool, vpool, tables, lens, scale):
    outs = []
    for b in range(q.shape[0]):
        r = rows(tables[b], int(lens[b]))
        k = kpool[:, r].float()[None]
        v = vpool[:, r].float()[None]
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
    blocks = 200
    kpool = torch.randn(kv_heads, blocks * BS, dim, dtype=dtype)
    vpool = torch.randn(kv_heads, blocks * BS, dim, dtype=dtype)
    lens = [1, 7, 130, 1000, 17]
    tables, tabs = scattered_tables(lens, blocks, seed=1)
    nan_outside(kpool, tables, lens)  # memory outside every sequence's blocks must never be read
    nan_outside(vpool, tables, lens)
    ln = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim, dtype=dtype)
    scale = dim ** -0.5
    full = kernel.decode_attention(q, kpool, vpool, tabs, ln, BS, scale)
    want = reference(q, kpool, vpool, tables, lens, scale)
    assert torch.isfinite(full).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(full.float(), want, atol=tol, rtol=tol), (full.float() - want).abs().max()
    for b in range(len(lens)):
        # a row is computed alone: the same result in any batch
        one = kernel.decode_attention(q[b:b + 1].contiguous(), kpool, vpool, tabs[b:b + 1], ln[b:b + 1], BS, scale)
        assert torch.equal(one[0], full[b])
        # and where its blocks lie changes nothing: the same keys in consecutive blocks give the same bits
        r = rows(tables[b], lens[b])
        kc, vc = torch.zeros_like(kpool), torch.zeros_like(vpool)
        kc[:, :lens[b]], vc[:, :lens[b]] = kpool[:, r], vpool[:, r]
        line = torch.arange(-(-lens[b] // BS))[None]
        assert torch.equal(kernel.decode_attention(q[b:b + 1].contiguous(), kc, vc, line, ln[b:b + 1], BS, scale)[0],
                           full[b])


def test_stores_new_keys_and_values_before_attending() -> None:
    torch.manual_seed(2)
    kv_heads, dim = 8, 128
    kpool = torch.randn(kv_heads, 512, dim, dtype=torch.bfloat16)
    vpool = torch.randn(kv_heads, 512, dim, dtype=torch.bfloat16)
    lens = [5, 60, 1]
    tables, tabs = scattered_tables(lens, 32, seed=3)
    ln = torch.tensor(lens)
    q = torch.randn(3, 16, dim, dtype=torch.bfloat16)
    k_new = torch.randn(3, kv_heads, dim, dtype=torch.bfloat16)
    v_new = torch.randn(3, kv_heads, dim, dtype=torch.bfloat16)
    kref, vref = kpool.clone(), vpool.clone()
    last = torch.stack([rows(t, n)[-1] for t, n in zip(tables, lens, strict=True)])
    kref[:, last], vref[:, last] = k_new.transpose(0, 1), v_new.transpose(0, 1)
    want = kernel.decode_attention(q, kref, vref, tabs, ln, BS, 0.1)
    got = kernel.decode_attention(q, kpool, vpool, tabs, ln, BS, 0.1, k_new, v_new)
    assert torch.equal(kpool, kref) and torch.equal(vpool, vref)
    assert torch.equal(got, want)


def test_refuses_block_ids_outside_the_pool() -> None:
    kpool = torch.zeros(2, 64, 32)
    q = torch.zeros(1, 2, 32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.decode_attention(q, kpool, kpool, torch.tensor([[4]]), torch.tensor([3]), BS, 1.0)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        kernel.decode_attention(q, kpool, kpool, torch.tensor([[0]]), torch.tensor([17]), BS, 1.0)


@pytest.mark.parametrize(("ctx", "n"), [(0, 5), (0, 128), (1400, 128), (61, 67), (130, 1)])
def test_prefill_chunk_attention_matches_float32(ctx: int, n: int) -> None:
    from qasr.engine.cpu.native import attention_kernel

    flash = attention_kernel()
    if flash is None:
        pytest.skip("no AVX512-BF16")
    torch.manual_seed(4)
    kv_heads, heads, dim, blocks = 8, 16, 128, 128
    kpool = torch.randn(kv_heads, blocks * BS, dim, dtype=torch.bfloat16)
    vpool = torch.randn(kv_heads, blocks * BS, dim, dtype=torch.bfloat16)
    tables, tabs = scattered_tables([ctx + n], blocks, seed=ctx + n)
    nan_outside(kpool, tables, [ctx + n])  # rows the sequence does not own (or not yet) must never be read
    nan_outside(vpool, tables, [ctx + n])
    r = rows(tables[0], ctx + n)
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16)
    scale = dim ** -0.5
    got = flash.prefill_attention(q, kpool, vpool, tabs[0], BS, ctx, scale)
    keys, values = kpool[:, r].float()[None], vpool[:, r].float()[None]
    causal = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n)[:, None])
    want = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values, attn_mask=causal,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=1.5e-2, rtol=1e-2), (got.float() - want).abs().max()
    # each query row is computed on its own: the first rows alone give the same bits
    if n > 3:
        head = flash.prefill_attention(q[:3].contiguous(), kpool, vpool, tabs[0], BS, ctx, scale)
        assert torch.equal(head, got[:3])
    # the same keys in consecutive blocks: the same bits
    kc, vc = torch.zeros_like(kpool), torch.zeros_like(vpool)
    kc[:, :ctx + n], vc[:, :ctx + n] = kpool[:, r], vpool[:, r]
    assert torch.equal(flash.prefill_attention(q, kc, vc, torch.arange(-(-(ctx + n) // BS)), BS, ctx, scale), got)


@pytest.mark.parametrize("cut", [1, 37, 64, 100])
def test_prefill_rows_do_not_depend_on_where_the_chunk_starts(cut: int) -> None:
    """Positions [ctx, ctx + n) as one chunk, or cut at ``cut`` into two chunks (the second with the first's
    keys as context): the same bits. The engine relies on it to continue a kept KV prefix from any position."""
    from qasr.engine.cpu.native import attention_kernel

    flash = attention_kernel()
    if flash is None:
        pytest.skip("no AVX512-BF16")
    torch.manual_seed(cut)
    kv_heads, heads, dim, blocks, ctx, n = 2, 4, 128, 16, 13, 130
    kpool = torch.randn(kv_heads, blocks * BS, dim, dtype=torch.bfloat16)
    vpool = torch.randn(kv_heads, blocks * BS, dim, dtype=torch.bfloat16)
    _, tabs = scattered_tables([ctx + n], blocks, seed=cut)
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16)
    scale = dim ** -0.5
    whole = flash.prefill_attention(q, kpool, vpool, tabs[0], BS, ctx, scale)
    first = flash.prefill_attention(q[:cut].contiguous(), kpool, vpool, tabs[0], BS, ctx, scale)
    second = flash.prefill_attention(q[cut:].contiguous(), kpool, vpool, tabs[0], BS, ctx + cut, scale)
    assert torch.equal(torch.cat([first, second]), whole)
