"""The CUDA backend (engine/cuda/): its planning on CPU tensors everywhere, its kernels on a GPU.

On CPU: the varlen metadata (query offsets, region starts, key lengths, KV write rows), the padded
reference attention against a float64 loop, the token-major pool against the CPU pool, decode buckets
and their padding, the one-copy uploads, and whole engines on the backend (its pool, runner and bucketed
decode steps, run without capture) giving the CPU backend's tokens. On CUDA (skipped here, run by
scripts/gpu_check.sh): flash varlen attention against the reference, captured decode graphs against the
same steps run eagerly, the float32 engine against the CPU engine, and one host sync per decoder step.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import noise
from devices import exact_float32, needs_cuda

from qasr.engine.cuda.attention import (
    choose_attention,
    flash_attention,
    flash_supported,
    reference_attention,
    self_test,
)
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import (
    bucket_for,
    decode_buckets,
    pack,
    pad_decode,
    upload,
    upload_meta,
    varlen_host,
)
from qasr.engine.cuda.prepare import graphs_mode
from qasr.engine.device import backend_for, prepare_model
from qasr.engine.engine import Engine, EngineConfig
from qasr.engine.kv_cache import KVPool
from qasr.engine.padded_attention import padded_plan
from qasr.model.checkpoint import load_checkpoint
from qasr.model.config import DecoderConfig, audio_token_count
from qasr.model.prompt import build_prompt

KV = 64 << 20
LENGTHS = [0.7, 9.3, 3.1, 16.2, 41.0]  # 41 s: a prompt of several prefill chunks


# ------------------------------------------------------------------------------------------ varlen plan
def test_varlen_host_lays_out_queries_regions_and_write_rows() -> None:
    # two decode rows, a chunk of 3 after 5 cached tokens, a fresh prompt of 4; regions out of order
    h = varlen_host(starts=[100, 10, 50, 0], query_lens=[1, 1, 3, 4], context_lens=[7, 0, 5, 0])
    assert h.cu_q.tolist() == [0, 1, 2, 5, 9] and h.cu_q.dtype == np.int32
    assert h.k_starts.tolist()[:4] == [100, 10, 50, 0] and h.k_starts.dtype == np.int32
    assert h.used_k.tolist() == [8, 1, 8, 4] and h.used_k.dtype == np.int32
    assert h.write_index.tolist() == [107, 10, 55, 56, 57, 0, 1, 2, 3] and h.write_index.dtype == np.int64
    assert (h.max_q, h.max_k) == (4, 8)


@pytest.mark.parametrize(("starts", "qlens", "ctxs"), [([], [], []), ([0], [0], [0]), ([0, 1], [1], [0, 0]),
                                                        ([0], [1], [-1])])
def test_varlen_host_refuses_malformed_batches(starts, qlens, ctxs) -> None:
    with pytest.raises(ValueError):
        varlen_host(starts, qlens, ctxs)


def test_padded_plan_masks_bottom_right_causal_and_stays_inside_each_region() -> None:
    starts, qlens, ctxs = [40, 0], [3, 1], [2, 4]  # a chunk of 3 over 2 cached keys; a decode row over 4
    p = padded_plan(starts, qlens, ctxs)
    assert p.q_index.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert p.k_index.tolist() == [[40, 41, 42, 43, 44], [0, 1, 2, 3, 4]]
    m = p.mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # query i sees keys 0 .. ctx + i
    assert m[1][0] == [1, 1, 1, 1, 1]
    assert p.out_index.tolist() == [0, 1, 2, 3]


def _naive(q, kc, vc, starts, qlens, ctxs, scale) -> torch.Tensor:
    """float64, one query row at a time."""
    out, row = [], 0
    group = q.shape[1] // kc.shape[1]
    for s, n, c in zip(starts, qlens, ctxs, strict=True):
        for i in range(n):
            k = kc[s:s + c + i + 1].double().repeat_interleave(group, 1)  # (keys, heads, hd)
            v = vc[s:s + c + i + 1].double().repeat_interleave(group, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[row].double(), k) * scale, -1)
            out.append(torch.einsum("hk,khd->hd", w, v).reshape(-1))
            row += 1
    return torch.stack(out)


def _random_pool(starts, qlens, ctxs, tokens=300, kv_heads=2, hd=16, heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.full((tokens + 1, kv_heads, hd), float("nan"))  # unwritten memory must never be read
    vc = torch.full((tokens + 1, kv_heads, hd), float("nan"))
    for s, n, c in zip(starts, qlens, ctxs, strict=True):
        kc[s:s + c + n] = torch.randn(c + n, kv_heads, hd, generator=gen)
        vc[s:s + c + n] = torch.randn(c + n, kv_heads, hd, generator=gen)
    q = torch.randn(sum(qlens), heads, hd, generator=gen)
    return q, kc, vc


def test_reference_attention_matches_a_float64_loop_and_reads_nothing_outside_the_regions() -> None:
    starts, qlens, ctxs = [200, 5, 60, 120], [1, 1, 9, 17], [30, 0, 40, 0]
    q, kc, vc = _random_pool(starts, qlens, ctxs)
    meta, _ = upload_meta(starts, qlens, ctxs, 2, torch.device("cpu"))
    got = reference_attention(q, kc, vc, meta, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _naive(q, kc, vc, starts, qlens, ctxs, 0.25), atol=1e-5, rtol=1e-5)


def test_self_test_accepts_the_reference_and_rejects_a_wrong_kernel() -> None:
    assert self_test(reference_attention, torch.device("cpu"), torch.float32, 4, 2, 16) is None

    def ignores_context(q, kc, vc, meta, scale):  # noqa: ANN001, ANN202 - a deliberately wrong kernel
        from dataclasses import replace
        return reference_attention(q, kc, vc, replace(meta, context_lens=(0,) * len(meta.context_lens)), scale)

    why = self_test(ignores_context, torch.device("cpu"), torch.float32, 4, 2, 16)
    assert why is not None and "relative error" in why
    assert "raised" in self_test(lambda *a: 1 / 0, torch.device("cpu"), torch.float32, 4, 2, 16)


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


def test_token_major_pool_attends_and_stores_like_the_cpu_pool() -> None:
    """Prefill chunks (one with a cached prefix), then mixed steps with decode rows first: same outputs as
    the head-major pool with torch attention, and the same keys and values stored, every layer."""
    cfg = _dec()
    ref = KVPool(cfg, 400, torch.device("cpu"), torch.float32)
    ours = TokenKVPool(cfg, 400, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    steps = [  # (starts, query_lens, context_lens, num_decode)
        ([0, 200], [24, 13], [0, 0], 0),
        ([200, 0], [30, 1], [13, 24], 0),  # a chunk over a cached prefix; a one-token chunk (not decode)
        ([0, 200], [1, 1], [25, 43], 2),
        ([0, 200, 300], [1, 1, 50], [26, 44, 0], 2),
    ]
    for starts, qlens, ctxs, nd in steps:
        n = sum(qlens)
        for layer in range(cfg.num_hidden_layers):
            q = torch.randn(n, 4, 16, generator=gen)
            k = torch.randn(n, 2, 16, generator=gen)
            v = torch.randn(n, 2, 16, generator=gen)
            want = ref.attend(layer, q, k, v, ref.build_meta(starts, qlens, ctxs, nd))
            got = ours.attend(layer, q, k, v, upload_meta(starts, qlens, ctxs, nd, ours.device)[0])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for s, length in ((0, 27), (200, 45), (300, 50)):
        assert torch.equal(ours.k[:, s:s + length], ref.k[:, :, s:s + length].transpose(1, 2))
        assert torch.equal(ours.v[:, s:s + length], ref.v[:, :, s:s + length].transpose(1, 2))


def test_pool_move_copies_a_region_and_the_scratch_row_lies_outside_the_allocator() -> None:
    pool = TokenKVPool(_dec(), 100, torch.device("cpu"), torch.float32)
    assert pool.k.shape == (2, 101, 2, 16) and pool.scratch == 100 and pool.allocator.capacity == 100
    pool.k[:, 10:15] = torch.randn(2, 5, 2, 16)
    pool.v[:, 10:15] = torch.randn(2, 5, 2, 16)
    pool.move(10, 60, 5)
    assert torch.equal(pool.k[:, 60:65], pool.k[:, 10:15]) and torch.equal(pool.v[:, 60:65], pool.v[:, 10:15])
    assert pool.nbytes == 2 * 2 * 101 * 2 * 16 * 4


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


def test_pad_decode_points_pad_rows_at_the_scratch_row() -> None:
    rows = pad_decode([5, 6], [30, 7], [0, 50], [30, 7], bucket=4, scratch=999)
    assert rows.ids == [5, 6, 0, 0] and rows.positions == [30, 7, 0, 0]
    assert rows.starts == [0, 50, 999, 999] and rows.context_lens == [30, 7, 0, 0] and rows.real == 2
    with pytest.raises(ValueError):
        pad_decode([1, 2, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0], bucket=2, scratch=9)


def test_upload_packs_arrays_into_one_buffer_and_returns_views() -> None:
    flat, spans = pack([[1, 2, 3], np.array([4]), []], np.int64)
    assert flat.tolist() == [1, 2, 3, 4] and spans == [(0, 3), (3, 1), (4, 0)]
    a, b, c = upload([[1, 2, 3], np.array([7, 8], dtype=np.int32), []], torch.int32, torch.device("cpu"))
    assert a.tolist() == [1, 2, 3] and b.tolist() == [7, 8] and c.numel() == 0
    assert a.dtype == torch.int32 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


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


# ------------------------------------------------------------------------------------------- the engine
def _prompt(ck, wave: np.ndarray) -> list[int]:
    return build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160))


def _tokens(ck, config: EngineConfig, waves, new_tokens: int = 20) -> tuple[list[list[int]], Engine]:
    with Engine(ck, config) as engine:
        futures = [engine.submit(_prompt(ck, w), waveform=w, max_new_tokens=new_tokens, ignore_eos=True)
                   for w in waves]
        return [f.result().token_ids for f in futures], engine


@pytest.fixture(scope="module")
def ck32(tiny_original):
    return load_checkpoint(tiny_original, device="cpu", dtype="float32")


def test_the_cuda_backend_on_cpu_tensors_gives_the_cpu_backends_tokens(ck32) -> None:
    """Its pool, runner, varlen metadata and bucketed decode steps (run without capture here), with the
    portable attention: the same tokens as the CPU backend, in batches and with prefix chunks."""
    waves = [noise(s, seed=k) for k, s in enumerate(LENGTHS)]
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, prefill_chunk=64, prefill_tokens=128), waves)
    got, engine = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, prefill_chunk=64, prefill_tokens=128,
                                             backend="cuda"), waves)
    assert got == want
    stats = engine.runner.stats()
    assert stats["bucketed_steps"] > 10 and stats["graph_replays"] == 0 and stats["eager_steps"] > 0
    unbucketed, engine = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, backend="cuda", cuda_graphs=False), waves)
    assert unbucketed == want and engine.runner.stats()["bucketed_steps"] == 0


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
def test_cuda_flash_varlen_matches_the_reference_on_a_large_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    starts, qlens, ctxs = [], [], []
    at = 0
    for i in range(24):  # 16 decode rows, then 8 chunks of up to 300 new tokens; contexts up to 1500
        n = 1 if i < 16 else int(torch.randint(2, 300, (1,), generator=gen))
        c = int(torch.randint(0, 1500, (1,), generator=gen))
        starts.append(at)
        qlens.append(n)
        ctxs.append(c)
        at += c + n + 17
    q, kc, vc = _random_pool(starts, qlens, ctxs, tokens=at, kv_heads=8, hd=128, heads=16, seed=5)
    dev = torch.device("cuda")
    meta, _ = upload_meta(starts, qlens, ctxs, 16, dev)
    got = flash_attention(q.to(dev, torch.bfloat16), kc.to(dev, torch.bfloat16), vc.to(dev, torch.bfloat16), meta,
                          128 ** -0.5).float()
    want = reference_attention(q.to(dev), kc.to(dev), vc.to(dev), meta, 128 ** -0.5)  # float32
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 2e-2


@needs_cuda
def test_cuda_float32_engine_gives_the_cpu_engines_tokens(tiny_original, ck32) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate(LENGTHS)]
    want, _ = _tokens(ck32, EngineConfig(kv_cache_bytes=KV, native_kernels=False), waves)  # nothing to compile
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
    stats = engine.runner.stats()
    assert stats["graph_failed"] is None and stats["graph_replays"] > 20, stats
    with Engine(ck, config) as eager:
        eager.runner.graphs.capture = False  # the same buckets and buffers, run eagerly
        futures = [eager.submit(_prompt(ck, w), waveform=w, max_new_tokens=40, ignore_eos=True) for w in waves]
        want = [f.result().token_ids for f in futures]
        assert eager.runner.stats()["graph_replays"] == 0 and eager.runner.stats()["bucketed_steps"] > 20
    assert got == want


@needs_cuda
def test_cuda_decoder_step_makes_one_host_sync(ck_bf16_cuda) -> None:
    """Mixed steps (decode rows beside prefill chunks with audio) and graph-replayed decode steps each
    synchronise with the device once: reading back the sampled tokens."""
    ck = ck_bf16_cuda
    with Engine(ck, EngineConfig(kv_cache_bytes=256 << 20, max_running=8)) as engine:
        warm = noise(3.0)
        engine.submit(_prompt(ck, warm), waveform=warm, max_new_tokens=8, ignore_eos=True).result()  # captures
        runner = engine.runner
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
        for f in [engine.submit(_prompt(ck, w), waveform=w, max_new_tokens=30, ignore_eos=True) for w in waves]:
            f.result()
    assert syncs["mixed"] and syncs["decode"], syncs
    assert set(syncs["mixed"]) == {1} and set(syncs["decode"]) == {1}, syncs
    assert engine.runner.stats()["graph_replays"] > 0
