"""The CUDA backend (engine/cuda/): its planning on CPU tensors everywhere, its kernels on a GPU.

On CPU: the varlen metadata (query offsets, key lengths, block tables, KV write rows, through block tables
consecutive and scattered), the padded reference attention and flash's arguments against float64 loops, the
paged pool against the CPU pool, decode and context buckets, key splits, the reused pinned staging, the GPU
defaults, the deferred finiteness checks, and whole engines on the backend (its pool, runner and bucketed decode
steps, run without capture) giving the CPU backend's tokens. On CUDA (skipped here, run by
scripts/gpu_check.sh): flash paged attention against the reference, captured decode graphs against the same
steps run eagerly, the float32 engine against the CPU engine, and one host sync per decoder step.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from conftest import noise
from devices import exact_float32, needs_cuda

from qasr.engine import validate
from qasr.engine.config import EngineConfig as Config
from qasr.engine.cuda import attention as cuda_attention
from qasr.engine.cuda import graphs as cuda_graphs
from qasr.engine.cuda import prepare as cuda_prepare
from qasr.engine.cuda.attention import (
    choose_attention,
    flash_attention,
    flash_schema_problem,
    flash_supported,
    reference_attention,
    rows_of,
    self_test,
)
from qasr.engine.cuda.fallback import MAX_KEY_SLOTS, MAX_SCORES, fallback_attention, fallback_plan, group_bytes
from qasr.engine.cuda.kv_cache import TokenKVPool, held_kv_bytes
from qasr.engine.cuda.plan import (
    PinnedStaging,
    block_table,
    bucket_for,
    context_buckets,
    decode_buckets,
    num_splits,
    pack,
    pad_decode,
    upload,
    upload_meta,
    varlen_host,
)
from qasr.engine.cuda.prepare import GPU_DEFAULTS, cuda_defaults, graphs_mode
from qasr.engine.device import backend_for, prepare_model
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_blocks import token_rows
from qasr.engine.kv_cache import KVPool
from qasr.engine.padded_attention import padded_attention, padded_plan
from qasr.model.checkpoint import load_checkpoint
from qasr.model.config import DecoderConfig, audio_token_count
from qasr.model.prompt import build_prompt

KV = 64 << 20
LENGTHS = [0.7, 9.3, 3.1, 16.2, 41.0]  # 41 s: a prompt of several prefill chunks
STAGING = PinnedStaging(torch.device("cpu"))


# ------------------------------------------------------------------------------------------ varlen plan
def regions(starts, qlens, ctxs) -> list[list[int]]:
    """Contiguous regions as block tables of one-token blocks (block_size 1): any start, any length."""
    return [list(range(s, s + c + n)) for s, n, c in zip(starts, qlens, ctxs, strict=True)]


def test_varlen_host_lays_out_queries_block_tables_and_write_rows() -> None:
    # blocks of 4: two decode rows, a chunk of 3 after 5 cached tokens, a fresh prompt of 4; tables out of order
    qlens, ctxs = [1, 1, 3, 4], [7, 0, 5, 0]
    tables = [[9, 2], [6], [3, 0, 8], [5]]
    h = varlen_host(tables, 4, qlens, ctxs)
    assert h.cu_q.tolist() == [0, 1, 2, 5, 9] and h.cu_q.dtype == np.int32
    assert h.used_k.tolist() == [8, 1, 8, 4] and h.used_k.dtype == np.int32
    assert h.cu_k.tolist() == [0, 8, 9, 17, 21] and h.cu_k.dtype == np.int32
    # each sequence's blocks in position order, as many as its keys fill, then 0 (never read)
    assert h.block_table.tolist() == [[9, 2], [6, 0], [3, 0], [5, 0]] and h.block_table.dtype == np.int32
    assert h.write_index.tolist() == [11, 24, 1, 2, 3, 20, 21, 22, 23] and h.write_index.dtype == np.int64
    assert (h.max_q, h.max_k) == (4, 8)


def test_block_tables_pad_to_the_width_asked_and_keep_only_the_blocks_in_use() -> None:
    table = block_table([[4, 7, 1], [2]], 16, [17, 3], width=5, pad=99)
    assert table.tolist() == [[4, 7, 99, 99, 99], [2, 99, 99, 99, 99]]


@pytest.mark.parametrize(("tables", "qlens", "ctxs"), [([], [], []), ([[0]], [0], [0]), ([[0], [1]], [1], [0, 0]),
                                                        ([[0]], [1], [-1]), ([[0]], [2], [0])])
def test_varlen_host_refuses_malformed_batches(tables, qlens, ctxs) -> None:
    with pytest.raises(ValueError):
        varlen_host(tables, 1, qlens, ctxs)


def test_padded_plan_masks_bottom_right_causal_and_stays_inside_each_region() -> None:
    starts, qlens, ctxs = [40, 0], [3, 1], [2, 4]  # a chunk of 3 over 2 cached keys; a decode row over 4
    p = padded_plan(regions(starts, qlens, ctxs), 1, qlens, ctxs)
    assert p.q_index.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert p.k_index.tolist() == [[40, 41, 42, 43, 44], [0, 1, 2, 3, 4]]
    m = p.mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # query i sees keys 0 .. ctx + i
    assert m[1][0] == [1, 1, 1, 1, 1]
    assert p.out_index.tolist() == [0, 1, 2, 3]


def _naive(q, kc, vc, tables, bs, qlens, ctxs, scale) -> torch.Tensor:
    """float64, one query row at a time, keys found through the block tables."""
    out, row = [], 0
    group = q.shape[1] // kc.shape[1]
    for t, n, c in zip(tables, qlens, ctxs, strict=True):
        for i in range(n):
            r = torch.from_numpy(token_rows(t, bs, 0, c + i + 1))
            k = kc[r].double().repeat_interleave(group, 1)  # (keys, heads, hd)
            v = vc[r].double().repeat_interleave(group, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[row].double(), k) * scale, -1)
            out.append(torch.einsum("hk,khd->hd", w, v).reshape(-1))
            row += 1
    return torch.stack(out)


def _random_pool(tables, bs, qlens, ctxs, tokens=300, kv_heads=2, hd=16, heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.full((tokens + 1, kv_heads, hd), float("nan"))  # unwritten memory must never be read
    vc = torch.full((tokens + 1, kv_heads, hd), float("nan"))
    for t, n, c in zip(tables, qlens, ctxs, strict=True):
        r = torch.from_numpy(token_rows(t, bs, 0, c + n))
        kc[r] = torch.randn(c + n, kv_heads, hd, generator=gen)
        vc[r] = torch.randn(c + n, kv_heads, hd, generator=gen)
    q = torch.randn(sum(qlens), heads, hd, generator=gen)
    return q, kc, vc


def _paged(q, kc, vc, meta, scale) -> torch.Tensor:
    """What flash's paged varlen forward computes, in float64 on the CPU, from the arguments flash_attention
    hands it: sequence b's queries are rows cu_q[b] .. cu_q[b + 1], its keys the first used_k[b] rows of the
    blocks its block_table row names (the paged pool (blocks, block_size, kv_heads, hd)), causal at the bottom
    right."""
    out = []
    bs = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    table = meta.block_table.long()
    for b in range(len(meta.query_lens)):
        q0, q1, used = int(meta.cu_q[b]), int(meta.cu_q[b + 1]), int(meta.used_k[b])
        pos = torch.arange(used)
        keys = kc[table[b, pos // bs], pos % bs].double().repeat_interleave(group, 1)
        values = vc[table[b, pos // bs], pos % bs].double().repeat_interleave(group, 1)
        for i in range(q1 - q0):
            seen = used - (q1 - q0) + i + 1
            w = torch.softmax(torch.einsum("hd,khd->hk", q[q0 + i].double(), keys[:seen]) * scale, -1)
            out.append(torch.einsum("hk,khd->hd", w, values[:seen]).reshape(-1))
    return torch.stack(out)


def _paged_pool(tables, bs, qlens, ctxs, blocks, kv_heads=2, hd=16, heads=4, seed=0):
    q, kc, vc = _random_pool(tables, bs, qlens, ctxs, tokens=blocks * bs - 1, kv_heads=kv_heads, hd=hd, heads=heads,
                             seed=seed)
    return q, kc.view(blocks, bs, kv_heads, hd), vc.view(blocks, bs, kv_heads, hd)


@pytest.mark.parametrize("layout", ["consecutive blocks", "scattered blocks"])
def test_reference_and_flash_arguments_match_a_float64_loop_and_read_nothing_outside_the_blocks(layout) -> None:
    """The reference attention, and the arguments flash is handed (the paged pool, the block table, the key
    lengths) run through a float64 paged loop, against a float64 loop over the tables: the same path for
    consecutive and scattered blocks, nothing gathered."""
    qlens, ctxs = [1, 1, 9, 17], [30, 0, 40, 0]
    if layout == "consecutive blocks":
        tables = [[12, 13], [0], [3, 4, 5, 6], [9, 10]]
    else:
        tables = [[7, 1], [16], [3, 11, 0, 5], [14, 9]]
    q, kc, vc = _paged_pool(tables, 16, qlens, ctxs, blocks=17)
    meta, _ = upload_meta(STAGING, tables, 16, qlens, ctxs, 2)
    want = _naive(q, rows_of(kc), rows_of(vc), tables, 16, qlens, ctxs, 0.25)
    got = reference_attention(q, kc, vc, meta, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_paged(q, kc, vc, meta, 0.25), want, atol=1e-9, rtol=1e-9)


def test_self_test_accepts_the_reference_and_rejects_a_wrong_kernel() -> None:
    assert self_test(reference_attention, torch.device("cpu"), torch.float32, 4, 2, 16) is None

    def ignores_context(q, kc, vc, meta, scale):  # noqa: ANN001, ANN202 - a deliberately wrong kernel
        from dataclasses import replace
        return reference_attention(q, kc, vc, replace(meta, context_lens=(0,) * len(meta.context_lens)), scale)

    why = self_test(ignores_context, torch.device("cpu"), torch.float32, 4, 2, 16)
    assert why is not None and "relative error" in why
    assert "raised" in self_test(lambda *a: 1 / 0, torch.device("cpu"), torch.float32, 4, 2, 16)


# ------------------------------------------------------------------ the fallback attention, by request kind
def _mixed_step(decode_ctxs, chunks, bs=16):
    """Decode rows over the given contexts, then prefill chunks (query rows, context), each in its own run
    of consecutive blocks with a free block between; returns the tables, lengths and the pool's tokens."""
    tables, qlens, ctxs, at = [], [], [], 0
    for n, c in [(1, c) for c in decode_ctxs] + list(chunks):
        k = -(-(c + n) // bs)
        tables.append(list(range(at, at + k)))
        qlens.append(n)
        ctxs.append(c)
        at += k + 1
    return tables, qlens, ctxs, at * bs


@pytest.mark.parametrize(("key_slots", "scores"), [(MAX_KEY_SLOTS, MAX_SCORES), (40, 300)])
def test_fallback_by_request_kind_gives_the_one_padded_batchs_results(key_slots: int, scores: int) -> None:
    """Decode rows in groups, each chunk alone and (with small limits) in blocks of query rows: the same
    outputs as the one padded batch of every row that the fallback used to run."""
    tables, qlens, ctxs, tokens = _mixed_step([30, 3, 17, 0, 44, 9], [(37, 120), (1, 20), (64, 0), (9, 5)])
    q, kc, vc = _random_pool(tables, 16, qlens, ctxs, tokens=tokens)
    plan = fallback_plan(tables, 16, qlens, ctxs, max_key_slots=key_slots, max_scores=scores)
    got = fallback_attention(q, kc, vc, plan, 0.25)
    want = padded_attention(q, kc, vc, padded_plan(tables, 16, qlens, ctxs), 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert sorted(torch.cat([g.rows for g in plan.groups]).tolist()) == list(range(sum(qlens)))
    if key_slots == 40:  # the limits did split: several decode groups, the 120-context chunk in blocks
        assert len(plan.groups) > 2 + 4
    meta, _ = upload_meta(STAGING, tables, 16, qlens, ctxs, 6)
    torch.testing.assert_close(reference_attention(q, kc, vc, meta, 0.25), want, atol=1e-6, rtol=1e-6)


def test_fallback_memory_stays_bounded_on_a_large_mixed_step() -> None:
    """512 decode rows over 1,500-2,100 cached tokens beside a 2048-token prefill chunk after 14,000: the one
    padded batch of every row would gather 17 GB of mask and 34 GB of keys and values at the 0.6B dims in
    bf16, before its scores (out of memory); the plan by request kind stays under 1 GiB (0.77). Computed
    from the plan's shapes on the CPU, nothing allocated on a device."""
    rng = np.random.default_rng(0)
    tables, qlens, ctxs, _ = _mixed_step([int(c) for c in rng.integers(1500, 2100, 512)], [(2048, 14000)])
    dims = dict(heads=16, kv_heads=8, head_dim=128, elem=2)  # Qwen3-ASR-0.6B's decoder, bf16
    old = sum(qlens) * 16 * 128 * 2 + group_bytes((513, 2048, 16048), **dims)  # output + one padded batch
    assert old > 50 * 2**30
    plan = fallback_plan(tables, 16, qlens, ctxs)
    assert plan.peak_bytes(**dims) < 2**30
    for g in plan.groups:
        s, mq, mk = g.shape
        assert (mq == 1 and (s * mk <= MAX_KEY_SLOTS or s == 1)) or (s == 1 and mq * mk <= MAX_SCORES), g.shape
    assert sorted(torch.cat([g.rows for g in plan.groups]).tolist()) == list(range(sum(qlens)))


# --------------------------------------------------------------------------------------- flash's signature
FLASH_WITHOUT_SEQUSED_K = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
    "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None) -> "
    "(Tensor output, Tensor softmax_logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)")


FLASH_WITHOUT_BLOCK_TABLE = FLASH_WITHOUT_SEQUSED_K.replace(
    "float? scale=None)", "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, "
    "Tensor? seqused_k=None, Tensor? alibi_slopes=None)")


def test_flash_needs_the_signature_it_calls(monkeypatch, caplog) -> None:
    """A torch whose flash op lacks ``seqused_k`` or ``block_table`` (or takes other arguments) is refused
    with one warning."""
    assert flash_schema_problem(torch.ops.aten._flash_attention_forward.default._schema) is None  # this torch's
    old = torch._C.parse_schema(FLASH_WITHOUT_SEQUSED_K)
    assert "seqused_k" in flash_schema_problem(old)
    assert "no block_table argument" in flash_schema_problem(torch._C.parse_schema(FLASH_WITHOUT_BLOCK_TABLE))
    reordered = torch._C.parse_schema(FLASH_WITHOUT_SEQUSED_K.replace("Tensor? cum_seq_q, Tensor? cum_seq_k", "Tensor? "
                                                                      "cum_seq_k, Tensor? cum_seq_q"))
    assert "takes" in flash_schema_problem(reordered)
    assert "no aten._flash_attention_forward" in flash_schema_problem(None)
    monkeypatch.setattr(cuda_attention, "_flash_schema", lambda: old)
    monkeypatch.setattr(cuda_attention, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="qasr.engine.cuda.attention"):
        for _ in range(3):
            why = flash_supported(torch.device("cuda"), torch.bfloat16, 128)
            assert why is not None and "seqused_k" in why
        attention, what = choose_attention(torch.device("cuda"), torch.bfloat16, 16, 8, 128)
    assert attention is reference_attention and "seqused_k" in what
    assert sum("seqused_k" in r.getMessage() for r in caplog.records) == 1


def test_flash_is_never_chosen_where_it_cannot_run() -> None:
    assert flash_supported(torch.device("cpu"), torch.bfloat16, 128) == "not a CUDA device"
    assert "float32" in flash_supported(torch.device("cuda"), torch.float32, 128)
    assert "head_dim" in flash_supported(torch.device("cuda"), torch.bfloat16, 100)
    attention, why = choose_attention(torch.device("cpu"), torch.bfloat16, 16, 8, 128)
    assert attention is reference_attention and "not a CUDA device" in why


# ---------------------------------------------------------------------------------------------- the pool
def _dec(layers: int = 2) -> DecoderConfig:
    return DecoderConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)


def test_paged_pool_attends_and_stores_like_the_cpu_pool() -> None:
    """Prefill chunks (one with a cached prefix), then mixed steps with decode rows first: same outputs as
    the head-major pool with torch attention, and the same keys and values stored, every layer."""
    cfg = _dec()
    ref = KVPool(cfg, 25, torch.device("cpu"), torch.float32, block_size=16)
    ours = TokenKVPool(cfg, 25, 16, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    a, b, c = [0, 1], [12, 4, 7], [20, 9, 15, 2]  # consecutive; scattered; scattered, out of order
    steps = [  # (tables, query_lens, context_lens, num_decode)
        ([a, b], [24, 13], [0, 0], 0),
        ([b, a], [30, 1], [13, 24], 0),  # a chunk over a cached prefix; a one-token chunk (not decode)
        ([a, b], [1, 1], [25, 43], 2),
        ([a, b, c], [1, 1, 50], [26, 44, 0], 2),
    ]
    for tables, qlens, ctxs, nd in steps:
        n = sum(qlens)
        for layer in range(cfg.num_hidden_layers):
            q = torch.randn(n, 4, 16, generator=gen)
            k = torch.randn(n, 2, 16, generator=gen)
            v = torch.randn(n, 2, 16, generator=gen)
            want = ref.attend(layer, q, k, v, ref.build_meta(tables, qlens, ctxs, nd))
            got = ours.attend(layer, q, k, v, upload_meta(STAGING, tables, 16, qlens, ctxs, nd)[0])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for t, length in ((a, 27), (b, 45), (c, 50)):
        r = torch.from_numpy(token_rows(t, 16, 0, length))
        assert torch.equal(ours.k.flatten(1, 2)[:, r], ref.k[:, :, r].transpose(1, 2))
        assert torch.equal(ours.v.flatten(1, 2)[:, r], ref.v[:, :, r].transpose(1, 2))


def test_the_scratch_block_lies_outside_the_allocator() -> None:
    pool = TokenKVPool(_dec(), 25, 4, torch.device("cpu"), torch.float32)
    assert pool.k.shape == (2, 26, 4, 2, 16) and (pool.scratch_block, pool.scratch) == (25, 100)
    assert pool.allocator.capacity == 100
    assert pool.allocator.alloc(25) == list(range(25)) and pool.allocator.alloc(1) is None
    assert pool.nbytes == 2 * 2 * 26 * 4 * 2 * 16 * 4


def test_flash_pools_take_blocks_of_a_multiple_of_256_tokens() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        TokenKVPool(_dec(), 4, 64, torch.device("cpu"), torch.float32, attention=flash_attention)
    assert TokenKVPool(_dec(), 2, 512, torch.device("cpu"), torch.float32, attention=flash_attention).block_size == 512


def test_every_pool_on_a_device_counts_in_its_kv_budget() -> None:
    """``held_kv_bytes`` (what the engines' default sizes subtract) counts each live pool until it is gone."""
    before = held_kv_bytes(torch.device("cpu"))
    pools = [TokenKVPool(_dec(), n, 16, torch.device("cpu"), torch.float32) for n in (3, 5)]
    assert held_kv_bytes(torch.device("cpu")) - before == sum(p.nbytes for p in pools)
    del pools
    import gc

    gc.collect()
    assert held_kv_bytes(torch.device("cpu")) == before


# ------------------------------------------------------------------------------------ buckets and uploads
def test_decode_buckets_cover_every_batch_with_under_a_third_padding() -> None:
    assert decode_buckets(64) == (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(100)[-1] == 128 and decode_buckets(512)[-1] == 512
    buckets = decode_buckets(512)
    for n in range(1, 513):
        b = bucket_for(n, buckets)
        assert b is not None and n <= b and (b - n) < b / 3
    assert bucket_for(513, buckets) is None
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_pad_decode_points_pad_rows_at_the_scratch_block() -> None:
    rows = pad_decode([5, 6], [30, 7], [[0, 3], [9]], [30, 7], bucket=4, scratch_block=99)
    assert rows.ids == [5, 6, 0, 0] and rows.positions == [30, 7, 0, 0]
    assert rows.tables == [[0, 3], [9], [99], [99]] and rows.context_lens == [30, 7, 0, 0] and rows.real == 2
    with pytest.raises(ValueError):
        pad_decode([1, 2, 3], [0, 0, 0], [[0]] * 3, [0, 0, 0], bucket=2, scratch_block=9)


def test_context_buckets_are_whole_blocks_up_to_the_capacity() -> None:
    assert context_buckets(409_600, 256) == (2048, 8192, 32768, 131072, 409600)
    assert context_buckets(65536, 256) == (2048, 8192, 32768, 65536)
    assert context_buckets(1000, 256) == (1024,) and context_buckets(3000, 16) == (2048, 3008)
    for n in range(1, 5000, 37):
        k = bucket_for(n, context_buckets(5000, 256))
        assert k is not None and n <= k and k % 256 == 0


def test_key_splits_fill_the_device_only_where_its_tasks_do_not() -> None:
    # 264 slots (an H100's 132 SMs, two tasks each); 8 kv heads: from 27 sequences the tasks fill them alone
    assert num_splits(32, 8, 65536, 264) == 1 and num_splits(27, 8, 65536, 264) == 1
    assert num_splits(1, 8, 65536, 264) == 33 and num_splits(4, 8, 65536, 264) == 8
    assert num_splits(1, 8, 2048, 264) == 16  # at least 128 keys a part
    assert num_splits(1, 1, 10**6, 10**4) == 128  # at most 128 parts
    assert num_splits(1, 8, 1, 264) == 1


def test_upload_packs_arrays_into_one_buffer_and_returns_views() -> None:
    flat, spans = pack([[1, 2, 3], np.array([4]), []], np.int64)
    assert flat.tolist() == [1, 2, 3, 4] and spans == [(0, 3), (3, 1), (4, 0)]
    a, b, c = upload(PinnedStaging(torch.device("cpu")), [[1, 2, 3], np.array([7, 8], dtype=np.int32), []],
                     torch.int32)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [7, 8] and c.numel() == 0
    assert a.dtype == torch.int32 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class DoneLater:
    """A CUDA event stood in for: not done until ``done`` is set."""

    done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return DoneLater.done


def test_staging_reuses_its_buffer_and_never_overwrites_one_a_copy_still_reads(monkeypatch) -> None:
    """Uploads take consecutive regions of one host buffer, grown when too small; a full buffer is started over
    only once the copy that last read it has run, else another is added; the copies on the device are the
    data, not views of the buffer."""
    staging = PinnedStaging(torch.device("cpu"))
    a = staging.upload(np.arange(10, dtype=np.int32))
    ptr = staging._buffers[0][0].data_ptr()
    b = staging.upload(np.arange(100, dtype=np.int64))
    assert len(staging._buffers) == 1 and staging._buffers[0][0].data_ptr() == ptr and staging.nbytes == 4096
    assert staging._buffers[0][1] == 64 + 832  # two regions, 64-byte aligned
    assert a.tolist() == list(range(10)) and b.tolist() == list(range(100))  # separate from the buffer
    staging.upload(np.zeros(3000, dtype=np.float32))  # 12 kB: the buffer grows once, and starts over
    assert len(staging._buffers) == 1 and staging.nbytes == 16384 and staging._buffers[0][1] == 12032
    # on CUDA each copy records an event: a full buffer whose last copy has not run is left alone
    monkeypatch.setattr(DoneLater, "done", False)
    staging._buffers[0][2] = DoneLater()
    c = staging.upload(np.arange(1000, dtype=np.int64))  # 8 kB: does not fit what is left
    assert len(staging._buffers) == 2 and c.tolist() == list(range(1000))
    first = staging._buffers[0][0].data_ptr()
    monkeypatch.setattr(DoneLater, "done", True)
    staging._buffers[1][2] = DoneLater()
    staging.upload(np.zeros(3000, dtype=np.float32))  # the second is full: the first, its copy run, starts over
    assert len(staging._buffers) == 2 and staging._buffers[0][0].data_ptr() == first and staging._current == 0


def test_backend_choice_is_made_in_one_place(tiny_original) -> None:
    ck = load_checkpoint(tiny_original, device="cpu", dtype="float32")
    assert backend_for(ck.model) == "cpu" and backend_for(ck.model, "cuda") == "cuda"
    with pytest.raises(ValueError):
        backend_for(ck.model, "tpu")
    cuda = prepare_model(ck.model, backend="cuda")
    assert cuda.backend == "cuda" and cuda.make_pool is not None and "portable" in cuda.description
    assert prepare_model(ck.model, backend="cuda") is cuda  # prepared once per model
    assert prepare_model(ck.model).make_pool is None  # the CPU backend keeps engine/kv_cache.KVPool
    assert graphs_mode("cuda", flash=True, wanted=True) == "capture"
    assert graphs_mode("cuda", flash=False, wanted=True) == "off"  # the portable attention's shapes vary
    assert graphs_mode("cpu", flash=False, wanted=True) == "eager" and graphs_mode("cpu", False, False) == "off"


def test_gpu_defaults_replace_only_the_fields_left_at_their_cpu_defaults() -> None:
    gpu = cuda_defaults(Config())
    assert all(getattr(gpu, name) == value for name, value in GPU_DEFAULTS.items())
    assert gpu.kv_block_tokens == 256 and gpu.max_running > Config().max_running
    mine = cuda_defaults(Config(max_running=32, step_tokens=2048, kv_cache_bytes=1 << 30))
    assert (mine.max_running, mine.step_tokens, mine.kv_cache_bytes) == (32, 2048, 1 << 30)
    assert mine.conv_batch == GPU_DEFAULTS["conv_batch"] and cuda_defaults(gpu) == gpu


def test_the_gpu_settings_apply_on_a_cuda_device_only(ck32) -> None:
    """On the CPU (the CUDA backend's planning on CPU tensors) the engine keeps the settings it was given;
    ``engine.config`` is what the core runs (callers size their work by it, e.g. max_running)."""
    with Engine(ck32, EngineConfig(kv_cache_bytes=KV, backend="cuda")) as engine:
        assert engine.core.config.kv_block_tokens == 64 and engine.core.pool.block_size == 64
        assert engine.config is engine.core.config


def test_the_asr_and_aligner_engines_share_one_kv_budget(monkeypatch) -> None:
    """Made in either order on one device with 100 GiB free, the ASR's and the aligner's default KV caches
    hold at most 60% of it together, the aligner about an eighth of that."""
    from qasr.engine import core
    from qasr.engine.cuda import kv_cache

    gib, weights = 2**30, 2 * 2**30  # the second model's weights, loaded before its engine
    for order in (("asr", "aligner"), ("aligner", "asr")):
        held = 0
        taken = {}
        for k, who in enumerate(order):
            free = 100 * gib - held - k * weights
            monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 140 * gib))
            monkeypatch.setattr(kv_cache, "held_kv_bytes", lambda device, held=held: held)
            taken[who] = core.default_kv_bytes(torch.device("cuda"), aligner=who == "aligner")
            held += taken[who]
        assert held <= 0.6 * 100 * gib
        assert 0.5 * 100 * gib < taken["asr"] and 0.06 * 100 * gib < taken["aligner"] < 0.08 * 100 * gib, taken


# --------------------------------------------------------------------- no host sync at submit (device tensors)
def _counting_reads(monkeypatch) -> list[str]:
    """The device types of every tensor whose value is read on the host (all, item, bool, tolist)."""
    reads: list[str] = []
    for name in ("all", "item", "__bool__", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            reads.append(self.device.type)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_device_audio_is_not_read_at_submit_and_host_audio_is(ck32, monkeypatch) -> None:
    """audio_embeds and conv heads on a device are checked for shape and device only (reading their values
    would wait for everything queued on the device); on the CPU they are checked for NaN at once."""
    cfg, enc = ck32.config, ck32.config.encoder
    limits = validate.Limits(cfg.audio_token_id, cfg.decoder.vocab_size, 160, enc.num_mel_bins,
                             enc.conv_chunk_frames, 10_000)
    prompt = [1, cfg.audio_token_id, cfg.audio_token_id, 2]
    hidden, meta = cfg.decoder.hidden_size, torch.device("meta")
    head = torch.empty(1, enc.tokens_per_conv_chunk, enc.d_model, device=meta)
    reads = _counting_reads(monkeypatch)
    validate.check_embeds(prompt, torch.empty(2, hidden, device=meta), 5, limits, hidden, meta)
    validate.check_conv_head(head, enc.conv_chunk_frames, enc, meta)
    assert "meta" not in reads
    with pytest.raises(ValueError, match="finite"):
        validate.check_embeds(prompt, torch.full((2, hidden), float("nan")), 5, limits, hidden, torch.device("cpu"))
    with pytest.raises(ValueError, match="finite"):
        validate.check_conv_head(torch.full(tuple(head.shape), float("inf")), enc.conv_chunk_frames, enc,
                                 torch.device("cpu"))
    assert "cpu" in reads


def test_non_finite_audio_rows_fail_their_request_in_the_step_that_reads_them(ck32, monkeypatch) -> None:
    """With the check at submit deferred (as for a device tensor), a request whose audio_embeds hold NaN
    fails with NonFiniteAudio when its step's tokens are read back; the request beside it gets its tokens."""
    from qasr.engine.cuda.runner import NonFiniteAudio

    monkeypatch.setattr(validate, "finite_or_deferred", lambda t: True)
    good, bad = noise(3.1, seed=1), noise(2.0, seed=2)
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV), [good], new_tokens=8)
    prompt = _prompt(ck32, bad)
    rows = torch.full((prompt.count(ck32.config.audio_token_id), ck32.config.decoder.hidden_size), float("nan"))
    with Engine(ck32, EngineConfig(kv_cache_bytes=KV, backend="cuda")) as engine:
        failing = engine.submit(RequestSpec(prompt, 8, audio_embeds=rows, ignore_eos=True))
        fine = engine.submit(RequestSpec(_prompt(ck32, good), 8, waveform=good, ignore_eos=True))
        with pytest.raises(NonFiniteAudio, match="NaN or infinity"):
            failing.result()
        assert fine.result().token_ids == want[0]


# ------------------------------------------------------------------------------------------- the engine
def _prompt(ck, wave: np.ndarray) -> list[int]:
    return build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160))


def _tokens(ck, config: EngineConfig, waves, new_tokens: int = 20) -> tuple[list[list[int]], Engine]:
    with Engine(ck, config) as engine:
        futures = [engine.submit(RequestSpec(_prompt(ck, w), new_tokens, waveform=w, ignore_eos=True))
                   for w in waves]
        return [f.result().token_ids for f in futures], engine


@pytest.fixture(scope="module")
def ck32(tiny_original):
    return load_checkpoint(tiny_original, device="cpu", dtype="float32")


def test_the_cuda_backend_on_cpu_tensors_gives_the_cpu_backends_tokens(ck32, monkeypatch) -> None:
    """Its pool, runner, varlen metadata and bucketed decode steps (run without capture here), with the
    portable attention: the same tokens as the CPU backend, in batches and with prefix chunks. Requests
    decoding side by side take their next blocks in turns, so their tables interleave: those steps are
    bucketed all the same (a graph reads the block tables it is handed). The uploads reuse one staging buffer."""
    from qasr.engine.kv_blocks import contiguous_start

    scattered: list[bool] = []
    run = cuda_graphs.DecodeGraphs.run

    def spy(self, ids, positions, tables, ctxs):  # noqa: ANN001, ANN202 - DecodeGraphs.run's arguments
        scattered.append(any(contiguous_start(t, self.pool.block_size, c + 1) is None
                             for t, c in zip(tables, ctxs, strict=True)))
        return run(self, ids, positions, tables, ctxs)

    buffers: set[int] = set()
    uploads = 0
    upload_one = PinnedStaging.upload

    def seen(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        nonlocal uploads
        uploads += 1
        out = upload_one(self, *args, **kwargs)
        buffers.update(b[0].data_ptr() for b in self._buffers)
        return out

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", spy)
    monkeypatch.setattr(PinnedStaging, "upload", seen)
    waves = [noise(s, seed=k) for k, s in enumerate(LENGTHS)]
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, prefill_chunk=64, step_tokens=128), waves)
    got, engine = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, prefill_chunk=64, step_tokens=128,
                                             backend="cuda", kv_block_tokens=16), waves)
    assert got == want
    stats = engine.core.runner.stats()
    assert sum(scattered) > 10 and stats["bucketed_steps"] == len(scattered) and stats["graph_replays"] == 0
    assert uploads > 100 and len(buffers) <= 2 and stats["staging_bytes"] <= 8192
    unbucketed, engine = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, backend="cuda", cuda_graphs=False), waves)
    assert unbucketed == want and engine.core.runner.stats()["bucketed_steps"] == 0


def test_scattered_and_consecutive_tables_share_a_graph_and_its_result(ck32) -> None:
    """The same decode rows over consecutive and over scattered blocks (same keys stored): one (batch,
    context) bucket, its static buffers loaded with either table, the same tokens and log-probabilities; the
    bucket follows the longest real context, not the pool's capacity."""
    with Engine(ck32, EngineConfig(kv_cache_bytes=KV, backend="cuda", kv_block_tokens=16)) as engine:
        runner = engine.core.runner
        graphs, pool = runner.graphs, runner.pool
        assert graphs.context_buckets[-1] == min(pool.tokens, ck32.config.decoder.max_position_embeddings)
        assert graphs.key(3, [40, 2000, 7]) == (4, 2048) and graphs.key(3, [40, 2048, 7]) == (4, 8192)
        ctxs = [40, 7, 100]
        consecutive, scattered = [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9, 10]], [[9, 2, 30], [17], [5, 12, 3, 25, 8, 1, 40]]
        results, steps = [], []
        for tables in (consecutive, scattered):  # the same keys at each layout's rows
            gen = torch.Generator().manual_seed(3)
            for t, c in zip(tables, ctxs, strict=True):
                rows = torch.from_numpy(token_rows(t, 16, 0, c))
                for cache in (pool.k, pool.v):
                    cache.flatten(1, 2)[:, rows] = torch.randn(cache.shape[0], c, *cache.shape[-2:], generator=gen)
            with torch.inference_mode():
                results.append(graphs.run([5, 9, 11], ctxs, tables, ctxs))
            steps.append(graphs._steps[graphs.key(3, ctxs)])
        (a, b), step = results, steps[0]
        assert steps[1] is step and step.table.shape == (4, 2048 // 16)
        assert a[0] == b[0]
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6)
        assert step.table[:3, :3].tolist() == [[9, 2, 30], [17, pool.scratch_block, pool.scratch_block],
                                               [5, 12, 3]]


class FakeGraph:
    """Stands in for a captured CUDA graph on CPU tensors: a replay runs its step's forward on the rows
    loaded into the static buffers (what a graph does); ``broken`` makes every replay's tokens wrong."""

    broken = False
    captured: list[int] = []

    def __init__(self, forward, mempool) -> None:  # noqa: ANN001 - capture_graph's arguments
        self.step = forward.__self__  # the _Step whose captured_forward is recorded
        FakeGraph.captured.append((self.step.rows, self.step.max_k))

    def replay(self) -> None:
        self.step.forward(self.step.meta(self.step._rows))  # on CPU the attention reads the rows' host plan
        if FakeGraph.broken:
            self.step.tokens.add_(1)


@pytest.fixture
def fake_capture(monkeypatch):
    """The CUDA backend's runner in capture mode on CPU tensors, with FakeGraph for the capture."""
    monkeypatch.setattr(cuda_prepare, "graphs_mode", lambda *a: "capture")
    monkeypatch.setattr(cuda_graphs, "capture_graph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(FakeGraph, "broken", False)
    monkeypatch.setattr(FakeGraph, "captured", [])
    return FakeGraph


def test_capture_is_thread_local() -> None:
    """capture_graph asks torch for a thread-local capture (other threads' syncs cannot spoil it), after
    two warm-up forwards on a side stream."""
    calls: dict = {}

    class Stream:
        def wait_stream(self, other) -> None:  # noqa: ANN001
            pass

    class Graph:
        pass

    class Capture:
        def __init__(self, graph, **kwargs) -> None:  # noqa: ANN001
            calls.update(kwargs, graph=graph)

        def __enter__(self) -> None:
            calls["forwards_before_capture"] = calls.get("forwards", 0)

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            pass

    import contextlib

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(torch.cuda, "Stream", Stream)
        mp.setattr(torch.cuda, "current_stream", Stream)
        mp.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        mp.setattr(torch.cuda, "CUDAGraph", Graph)
        mp.setattr(torch.cuda, "graph", Capture)

        def forward() -> None:
            calls["forwards"] = calls.get("forwards", 0) + 1

        graph = cuda_graphs.capture_graph(forward, "pool")
    finally:
        mp.undo()
    assert calls["capture_error_mode"] == "thread_local" and calls["pool"] == "pool" and calls["graph"] is graph
    assert calls["forwards_before_capture"] == 2 and calls["forwards"] == 3


def test_decode_graphs_are_captured_at_engine_start_and_replay_the_eager_tokens(ck32, fake_capture) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate((0.7, 3.1, 9.3))]
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV), waves, new_tokens=12)
    config = EngineConfig(kv_cache_bytes=KV, backend="cuda", max_running=8)
    with Engine(ck32, config) as engine:
        graphs = engine.core.runner.graphs
        # every (batch, context) bucket, before any request
        assert sorted(fake_capture.captured) == [(b, k) for b in (1, 2, 4, 6, 8) for k in graphs.context_buckets]
        assert all(step.graph is not None for step in graphs._steps.values())
        futures = [engine.submit(RequestSpec(_prompt(ck32, w), 12, waveform=w, ignore_eos=True)) for w in waves]
        got = [f.result().token_ids for f in futures]
    stats = engine.core.runner.stats()
    assert got == want
    assert stats["graph_failed"] is None and stats["graph_replays"] > 5, stats
    assert any(step.verified for step in graphs._steps.values())  # first replays checked against eager


def test_a_replay_that_differs_from_the_eager_forward_drops_the_graphs_with_one_warning(ck32, fake_capture,
                                                                                        caplog) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate((0.7, 3.1, 9.3))]
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV), waves, new_tokens=12)
    config = EngineConfig(kv_cache_bytes=KV, backend="cuda", max_running=8)
    with caplog.at_level(logging.WARNING, logger="qasr.engine.cuda.graphs"):
        with Engine(ck32, config) as engine:
            fake_capture.broken = True  # after the capture's own check: the first real replay disagrees
            futures = [engine.submit(RequestSpec(_prompt(ck32, w), 12, waveform=w, ignore_eos=True))
                       for w in waves]
            got = [f.result().token_ids for f in futures]
    stats = engine.core.runner.stats()
    assert got == want  # the eager forward's tokens, from the mismatching step on
    assert stats["graph_replays"] == 0 and stats["bucketed_steps"] > 5 and "replay gave" in stats["graph_failed"]
    assert all(step.graph is None for step in engine.core.runner.graphs._steps.values())
    assert sum("disagreed" in r.getMessage() for r in caplog.records) == 1


def test_embedding_with_known_audio_rows_equals_finding_them(ck32) -> None:
    model = ck32.model
    audio_id = ck32.config.audio_token_id
    ids = torch.tensor([1, audio_id, audio_id, 5, audio_id, 7])
    audio = torch.randn(3, ck32.config.decoder.hidden_size)
    with torch.inference_mode():
        found = model.embed(ids, audio)
        given = model.embed(ids, audio, torch.tensor([1, 2, 4]))
        assert torch.equal(found, given)
        with pytest.raises(ValueError):
            model.embed(ids, audio, torch.tensor([1, 2]))


# --------------------------------------------------------------------------------- on a GPU (CUDA only)
@needs_cuda
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(16, 8, 128), (4, 2, 16), (16, 16, 64)])
def test_cuda_flash_varlen_passes_its_self_test(heads: int, kv_heads: int, hd: int) -> None:
    assert self_test(flash_attention, torch.device("cuda"), torch.bfloat16, heads, kv_heads, hd) is None
    attention, why = choose_attention(torch.device("cuda"), torch.bfloat16, heads, kv_heads, hd)
    assert attention is flash_attention, why


@needs_cuda
def test_cuda_flash_paged_matches_the_reference_on_a_large_mixed_batch() -> None:
    """24 sequences over 256-token blocks, consecutive and scattered, the whole mixed batch and its decode rows
    alone (a decode graph's shape), in flash's own split choice and in 4 parts: the float32 reference's
    results within bf16's error."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(5)
    qlens, ctxs = [], []
    for i in range(24):  # 16 decode rows, then 8 chunks of up to 300 new tokens; contexts up to 1500
        qlens.append(1 if i < 16 else int(torch.randint(2, 300, (1,), generator=gen)))
        ctxs.append(int(torch.randint(0, 1500, (1,), generator=gen)))
    bs = 256
    need = [-(-(n + c) // bs) for n, c in zip(qlens, ctxs, strict=True)]
    blocks = sum(need) + 24
    order = torch.randperm(blocks, generator=gen).tolist()
    consecutive, at = [], 0
    for k in need:
        consecutive.append(list(range(at, at + k)))
        at += k + 1
    scattered = [order[sum(need[:b]):sum(need[:b + 1])] for b in range(24)]
    dev = torch.device("cuda")
    staging = PinnedStaging(dev)
    for tables in (consecutive, scattered):
        q, kc, vc = _paged_pool(tables, bs, qlens, ctxs, blocks=blocks, kv_heads=8, hd=128, heads=16, seed=5)
        for k in (24, 16):
            args = (tables[:k], bs, qlens[:k], ctxs[:k], min(k, 16))
            rows_q = q[:sum(qlens[:k])]
            meta, _ = upload_meta(staging, *args)
            want = reference_attention(rows_q.to(dev), kc.to(dev), vc.to(dev), meta, 128 ** -0.5)  # float32
            for splits in (None, 4):
                got = flash_attention(rows_q.to(dev, torch.bfloat16), kc.to(dev, torch.bfloat16),
                                      vc.to(dev, torch.bfloat16), replace(meta, num_splits=splits), 128 ** -0.5)
                got = got.float()
                assert torch.isfinite(got).all()
                assert ((got - want).norm() / want.norm()).item() < 2e-2


@needs_cuda
def test_cuda_float32_engine_gives_the_cpu_engines_tokens(tiny_original, ck32) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate(LENGTHS)]
    # the CPU engine with the settings the CUDA engine takes (the same steps), torch ops: nothing to compile
    want, _ = _tokens(ck32, cuda_defaults(EngineConfig(kv_cache_bytes=KV, native_kernels=False)), waves)
    with exact_float32():
        ck = load_checkpoint(tiny_original, device="cuda", dtype="float32")
        got, engine = _tokens(ck, EngineConfig(kv_cache_bytes=KV), waves)
    assert engine.prepared.backend == "cuda"
    assert got == want


@pytest.fixture(scope="module")
def ck_bf16_cuda(tmp_path_factory):
    from qasr.testing import make_tiny_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("d128cuda"), seed=3, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    return load_checkpoint(path, device="cuda", dtype="bfloat16")


@needs_cuda
def test_cuda_decode_graphs_replay_what_the_same_steps_give_eagerly(ck_bf16_cuda) -> None:
    """Captured graphs against the same bucketed static-buffer steps run without capture: identical tokens."""
    ck = ck_bf16_cuda
    waves = [noise(s, seed=k) for k, s in enumerate(LENGTHS * 3)]
    config = EngineConfig(kv_cache_bytes=256 << 20, max_running=16)
    got, engine = _tokens(ck, config, waves, new_tokens=40)
    stats = engine.core.runner.stats()
    assert stats["graph_failed"] is None and stats["graph_replays"] > 20, stats
    with Engine(ck, config) as eager:
        eager.core.runner.graphs.disable("eager on purpose")  # the same buckets and buffers, run eagerly
        futures = [eager.submit(RequestSpec(_prompt(ck, w), 40, waveform=w, ignore_eos=True)) for w in waves]
        want = [f.result().token_ids for f in futures]
        assert eager.core.runner.stats()["graph_replays"] == 0 and eager.core.runner.stats()["bucketed_steps"] > 20
    assert got == want


@needs_cuda
def test_cuda_decoder_step_makes_one_host_sync(ck_bf16_cuda) -> None:
    """Mixed steps (decode rows beside prefill chunks with audio) and graph-replayed decode steps each
    synchronise with the device at most once: reading back the sampled tokens (with the audio rows' finite
    flags); the uploads go through the reused pinned staging, never a blocking copy."""
    ck = ck_bf16_cuda
    with Engine(ck, EngineConfig(kv_cache_bytes=256 << 20, max_running=8)) as engine:
        warm = noise(3.0)
        engine.submit(RequestSpec(_prompt(ck, warm), 8, waveform=warm, ignore_eos=True)).result()  # captures
        runner = engine.core.runner
        forward = runner.forward
        syncs: dict[str, list[int]] = {"mixed": [], "decode": []}

        def counted(plan):  # noqa: ANN001, ANN202 - wraps Runner.forward on the engine thread
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = forward(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs["mixed" if plan.prefill else "decode"].append(
                sum("synchroniz" in str(w.message) for w in caught))
            return out

        runner.forward = counted
        waves = [noise(s, seed=k) for k, s in enumerate((2.0, 3.0, 30.0))]
        for f in [engine.submit(RequestSpec(_prompt(ck, w), 30, waveform=w, ignore_eos=True)) for w in waves]:
            f.result()
    assert syncs["mixed"] and syncs["decode"], syncs
    # a mixed step whose chunks sample no row reads nothing back
    assert set(syncs["mixed"]) <= {0, 1} and 1 in syncs["mixed"] and set(syncs["decode"]) == {1}, syncs
    assert engine.core.runner.stats()["graph_replays"] > 0
