"""The int8 KV cache (EngineConfig.kv_cache_dtype="int8"): its arithmetic, the native decode kernel over it, and
the engine with it, against plain torch references of the same quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import greedy_without_engine, noise, prompt_for

from qasr.engine.cpu.native import decode_kernel, linear_kernel
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import KVPool, dequantize_kv, kv_bytes_per_token, quantize_kv_reference
from qasr.model.kernels import TORCH_KERNELS

WAIT_S = 120
KV = 64 << 20
kernel = decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="qasr's decode attention kernel did not build here")


# ------------------------------------------------------------------------------------------- the arithmetic
def rows_to_quantize(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 4, 128, generator=gen) * torch.rand(300, 4, 1, generator=gen) * 8
    x[5, 1] = 0  # an all-zero row
    x[6, 2] = 1e-20  # a tiny one
    x[7, 0, :3] = torch.tensor([2.0, -1.0, 1.0])  # x * 127 / amax: 127 and the ties -63.5, 63.5
    x[7, 0, 3:] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_per_row_symmetric_and_its_error_is_bounded(dtype: torch.dtype) -> None:
    x = rows_to_quantize(dtype)
    q, s = quantize_kv_reference(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == x.shape and s.shape == x.shape[:-1]
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[5, 1], torch.zeros(128, dtype=torch.int8)) and float(s[5, 1]) == 0
    assert q[7, 0, :3].tolist() == [127, -64, 64]  # round half to even
    err = (dequantize_kv(q, s, torch.float32) - x.float()).abs()
    amax = x.float().abs().amax(-1, keepdim=True)
    assert bool((err <= amax / 254 * (1 + 1e-5)).all())  # half a step of amax / 127
    # a row's quantization is its own: quantizing a slice gives the same bits
    q2, s2 = quantize_kv_reference(x[100:103])
    assert torch.equal(q2, q[100:103]) and torch.equal(s2, s[100:103])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_quantizer_equals_the_torch_definition(dtype: torch.dtype) -> None:
    x = rows_to_quantize(dtype)
    q, s = kernel.quantize_kv(x)
    want_q, want_s = quantize_kv_reference(x)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


# ------------------------------------------------------------------------------------------- the kernel
def scattered(kv_heads: int, d: int, bs: int, gen: torch.Generator):  # noqa: ANN201
    """An int8 pool of 14 blocks whose scales are NaN outside the rows three sequences own (a kernel that
    reads a row it was not given returns NaN), the sequences' tables out of order."""
    tables = [[3], [12, 1, 7, 4, 10], [6, 0, 9]]
    lens = torch.tensor([1, 70, 33])
    shape = (kv_heads, 14 * bs, d)
    kq = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    vq = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    ks, vs = torch.full(shape[:2], float("nan")), torch.full(shape[:2], float("nan"))
    for t, n in zip(tables, lens.tolist(), strict=True):
        pos = torch.arange(n)
        rows = torch.tensor(t)[pos // bs] * bs + pos % bs
        ks[:, rows] = torch.rand(kv_heads, n, generator=gen) / 20
        vs[:, rows] = torch.rand(kv_heads, n, generator=gen) / 20
    tabs = torch.tensor([t + [0] * (5 - len(t)) for t in tables])
    return tables, tabs, lens, kq, vq, ks, vs


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "d", "dtype"), [
    (4, 4, 128, torch.bfloat16), (8, 4, 128, torch.bfloat16), (16, 4, 128, torch.bfloat16),  # the AVX-512 path
    (4, 2, 64, torch.bfloat16), (6, 2, 48, torch.float32)])  # the portable loop
def test_int8_decode_attention_is_attention_over_the_values_it_stores(heads, kv_heads, d, dtype) -> None:
    """The new rows are stored as the torch definition quantizes them; the result is float32 attention over the
    stored values (read as float(q) * scale on the AVX-512 path, whose queries are rounded to int16 per row, and
    rounded to the model's dtype on the portable one, whose bf16 result is then the bf16 kernel's over those
    values bit for bit); no row outside the tables is read (their scales are NaN); a sequence alone gets its
    bits in the batch."""
    gen = torch.Generator().manual_seed(heads * 100 + d)
    bs = 16
    tables, tabs, lens, kq, vq, ks, vs = scattered(kv_heads, d, bs, gen)
    q = torch.randn(3, heads, d, generator=gen).to(dtype)
    k_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
    v_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
    last = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens.tolist(), strict=True)]
    got = kernel.decode_attention_int8(q, kq, vq, ks, vs, tabs, lens, bs, d ** -0.5, k_new, v_new)
    assert bool(torch.isfinite(got).all())  # no row outside the tables was read
    for b, row in enumerate(last):  # the new rows were stored quantized, as the torch definition does it
        for pool, scales, new in ((kq, ks, k_new), (vq, vs, v_new)):
            nq, ns = quantize_kv_reference(new[b])
            assert torch.equal(pool[:, row], nq) and torch.equal(scales[:, row], ns)
    fast = d == 128 and dtype == torch.bfloat16
    read_as = torch.float32 if fast else dtype
    kd = dequantize_kv(kq, ks.nan_to_num(), read_as)
    vd = dequantize_kv(vq, vs.nan_to_num(), read_as)
    pos = [torch.tensor(t)[torch.arange(n) // bs] * bs + torch.arange(n) % bs
           for t, n in zip(tables, lens.tolist(), strict=True)]
    want = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[b].float()[None, :, None], kd[:, r].float()[None], vd[:, r].float()[None], scale=d ** -0.5,
        enable_gqa=True)[0, :, 0] for b, r in enumerate(pos)])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    if dtype == torch.bfloat16 and not fast:
        assert torch.equal(got, kernel.decode_attention(q, kd.contiguous(), vd.contiguous(), tabs, lens, bs, d ** -0.5))
    one = kernel.decode_attention_int8(q[1:2].contiguous(), kq, vq, ks, vs, tabs[1:2], lens[1:2], bs, d ** -0.5)
    assert torch.equal(one[0], got[1])  # a sequence alone: the same bits as in the batch


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(16, 8, 128), (8, 2, 64)])
def test_int8_decode_attention_over_uneven_long_contexts_is_split_by_keys_without_changing_a_bit(heads, kv_heads,
                                                                                              d) -> None:
    """Contexts of 1 to 1,500 keys in one call, enough work to run on both threads: the call splits the
    (sequence, head) tasks by the keys they read, and each sequence still gets the bits it gets alone and the
    float32 attention over the values it stores."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(d)
    bs, lens = 64, [1, 1500, 7, 130, 1000, 17]
    blocks = sum(-(-n // bs) for n in lens) + 3
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        tables.append(order[:-(-n // bs)])
        order = order[-(-n // bs):]
    tabs = torch.tensor([t + [0] * (24 - len(t)) for t in tables])
    kq = torch.randint(-127, 128, (kv_heads, blocks * bs, d), dtype=torch.int8, generator=gen)
    vq = torch.randint(-127, 128, (kv_heads, blocks * bs, d), dtype=torch.int8, generator=gen)
    ks = torch.rand(kv_heads, blocks * bs, generator=gen) / 20
    vs = torch.rand(kv_heads, blocks * bs, generator=gen) / 20
    q = torch.randn(len(lens), heads, d, generator=gen).to(torch.bfloat16)
    ln = torch.tensor(lens)
    got = kernel.decode_attention_int8(q, kq, vq, ks, vs, tabs, ln, bs, d ** -0.5)
    read_as = torch.float32 if d == 128 else torch.bfloat16
    kd, vd = dequantize_kv(kq, ks, read_as).float(), dequantize_kv(vq, vs, read_as).float()
    for b, (t, n) in enumerate(zip(tables, lens, strict=True)):
        r = torch.tensor(t)[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].float()[None, :, None], kd[:, r][None], vd[:, r][None], scale=d ** -0.5, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(got[b].float(), want, rtol=1e-2, atol=1e-2)
        one = kernel.decode_attention_int8(q[b:b + 1].contiguous(), kq, vq, ks, vs, tabs[b:b + 1], ln[b:b + 1], bs,
                                           d ** -0.5)
        assert torch.equal(one[0], got[b])


@needs_kernel
@pytest.mark.parametrize(("d", "dtype", "n", "length"), [
    (128, torch.bfloat16, 333, 384), (128, torch.bfloat16, 64, 64), (48, torch.bfloat16, 17, 64),  # AVX-512 only
    (40, torch.bfloat16, 9, 64),  # 16 dims at a time, then an 8-dim scalar tail
    (128, torch.float32, 100, 128), (40, torch.float32, 5, 5), (128, torch.bfloat16, 0, 64)])
def test_native_row_dequantization_equals_the_torch_gather_dequantize_and_pad(d, dtype, n, length) -> None:
    """What a prefill chunk's attention reads of an int8 pool: the named rows, in order, dequantized as
    dequantize_kv gives them (float(q) * scale rounded to the model's dtype, ties and tiny values included), and
    zeros up to the padded length; no row outside those named is read (the others' scales are NaN)."""
    gen = torch.Generator().manual_seed(d + n)
    kv_heads, pool = 3, 512
    kq = torch.randint(-127, 128, (kv_heads, pool, d), dtype=torch.int8, generator=gen)
    vq = torch.randint(-127, 128, (kv_heads, pool, d), dtype=torch.int8, generator=gen)
    rows = torch.randperm(pool, generator=gen)[:n]
    ks, vs = torch.full((kv_heads, pool), float("nan")), torch.full((kv_heads, pool), float("nan"))
    ks[:, rows] = torch.rand(kv_heads, n, generator=gen) * 2
    vs[:, rows] = torch.rand(kv_heads, n, generator=gen) / 1000
    if n:
        ks[0, rows[0]] = 0.0  # an all-zero row
        vs[1, rows[-1]] = 1e-30  # subnormal products
        kq[2, rows[0], :4] = torch.tensor([1, 3, 5, 7], dtype=torch.int8)
        ks[2, rows[0]] = 2 ** -8 + 2 ** -16  # products on bf16's rounding ties
    keys = torch.full((kv_heads, length, d), 7.0).to(dtype)  # garbage: every element must be written
    values = torch.full((kv_heads, length, d), 7.0).to(dtype)
    kernel.dequantize_kv_rows(kq, vq, ks, vs, rows, keys, values)
    for got, q, s in ((keys, kq, ks), (values, vq, vs)):
        want = torch.nn.functional.pad(dequantize_kv(q[:, rows], s[:, rows], dtype), (0, 0, 0, length - n))
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="row outside the pool"):
        kernel.dequantize_kv_rows(kq, vq, ks, vs, torch.tensor([pool]), keys, values)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_pools_prefill_reads_the_same_bits_with_and_without_the_native_dequantization(ck, dtype) -> None:  # noqa: ANN001
    """Two chunks of one sequence (the second reads the first's stored rows) through a pool over scattered
    blocks: the native one-pass store and dequantization and the torch quantize + index store and gather +
    dequantize give the same output bits and the same pool, with the native prefill attention where it runs and
    with SDPA."""
    from dataclasses import replace

    from qasr.engine.cpu.native import attention_kernel

    # head_dim 128: the shape the native prefill attention takes
    cfg = replace(ck.config.decoder, head_dim=128, num_attention_heads=4, num_key_value_heads=2)
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    for prefill in {None, attention_kernel() if dtype == torch.bfloat16 else None}:
        outs = []
        for native in (True, False):
            pool = KVPool(cfg, 12, torch.device("cpu"), dtype, block_size=16, decode_kernel=kernel,
                          prefill_kernel=prefill, kv_dtype="int8")
            if not native:
                pool.dequantize_rows = pool.store_int8 = None
            assert native == (pool.dequantize_rows is not None) == (pool.store_int8 is not None)
            table = [9, 2, 7, 0, 11, 4]
            got = []
            for ctx, n in ((0, 37), (37, 50)):
                meta = pool.build_meta([table], [n], [ctx])
                g = torch.Generator().manual_seed(ctx)
                q, k, v = (torch.randn(n, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
                got.append(pool.attend(0, q, k, v, meta))
            rows = torch.cat([torch.arange(b * 16, b * 16 + 16) for b in table])[:87]
            got += [pool.k[0][:, rows], pool.v[0][:, rows], pool.k_scale[0][:, rows], pool.v_scale[0][:, rows]]
            outs.append(got)
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- the pool
def test_an_int8_pool_takes_about_half_the_bytes(ck) -> None:  # noqa: ANN001
    cfg = ck.config.decoder
    per = kv_bytes_per_token(cfg, torch.bfloat16)
    per8 = kv_bytes_per_token(cfg, torch.bfloat16, "int8")
    assert per8 == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    pool = KVPool(cfg, 4, torch.device("cpu"), torch.bfloat16, block_size=16, kv_dtype="int8")
    assert pool.k.dtype == torch.int8 and pool.nbytes == per8 * pool.tokens < per * pool.tokens
    with pytest.raises(ValueError, match="KV cache dtype"):
        KVPool(cfg, 4, torch.device("cpu"), torch.bfloat16, kv_dtype="fp8")


def test_the_same_budget_holds_more_tokens(ck) -> None:  # noqa: ANN001
    budget = 1000 * kv_bytes_per_token(ck.config.decoder, ck.dtype)
    with Engine(ck, EngineConfig(kv_cache_bytes=budget, kv_block_tokens=16)) as plain, \
            Engine(ck, EngineConfig(kv_cache_bytes=budget, kv_block_tokens=16, kv_cache_dtype="int8")) as small:
        a, b = plain.stats().kv_tokens_total, small.stats().kv_tokens_total
    cfg = ck.config.decoder
    assert b / a == pytest.approx(4 * cfg.head_dim / (cfg.head_dim + 4), rel=0.03)  # float32: ~4x; bf16: ~2x


def test_config_refuses_unknown_dtypes_and_other_backends(ck) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="CPU backend only"):
        Engine(ck, EngineConfig(kv_cache_bytes=KV, backend="cuda", kv_cache_dtype="int8"))


# ------------------------------------------------------------------------------------------- the engine
def generate(ck, waves: list[np.ndarray], new_tokens: int = 10, **config) -> list:  # noqa: ANN001, ANN003
    with Engine(ck, EngineConfig(**{"kv_cache_bytes": KV, "kv_cache_dtype": "int8", **config})) as engine:
        futures = [engine.submit(RequestSpec(prompt_for(ck, w), new_tokens, waveform=w, ignore_eos=True))
                   for w in waves]
        return [f.result(WAIT_S) for f in futures]


@pytest.mark.parametrize("prefill_chunk", [256, 16])
def test_engine_tokens_equal_a_plain_reference_with_the_same_kv_quantization(ck, prefill_chunk: int) -> None:  # noqa: ANN001
    """Torch ops on both sides (float32): the engine's decode rows over the dequantized pool, prefill chunks of
    16 reading the earlier chunks' stored rows, against the whole sequence recomputed per token over a pool
    that stores every row int8 too."""
    waves = [noise(s, seed=60 + k) for k, s in enumerate((0.9, 4.3))]
    got = [r.token_ids for r in generate(ck, waves, native_kernels=False, prefill_chunk=prefill_chunk)]
    want = [greedy_without_engine(ck, w, 10, TORCH_KERNELS, kv_dtype="int8") for w in waves]
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_alone_and_in_a_batch_gets_the_same_tokens_and_log_probabilities(dtype, request) -> None:
    if dtype == "bfloat16" and linear_kernel() is None:
        pytest.skip("bf16 row invariance rests on qasr's AVX512-BF16 kernels")
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    waves = [noise(s, seed=70 + k) for k, s in enumerate((0.5, 2.2, 6.1, 1.3))]
    together = generate(ck, waves, new_tokens=12)
    for wave, batched in zip(waves, together, strict=True):
        alone = generate(ck, [wave], new_tokens=12, max_running=1)[0]
        assert alone.token_ids == batched.token_ids
        if dtype == "bfloat16" and kernel is not None:  # qasr's linears and decode attention: a row's bits are its own
            assert alone.logprobs == batched.logprobs


# ------------------------------------------------------------------------------------------- the front ends
def test_qasr_serve_takes_the_option_and_reports_the_cache_in_metrics(tmp_path) -> None:  # noqa: ANN001
    """A real server with ``--kv-cache-dtype int8``: it transcribes, and /metrics shows a pool of int8 rows
    (bytes per token as the int8 layout takes them, a quarter of float32's)."""
    import httpx
    from server_proc import DEMO_MODEL, ROOT, ServerProcess, metric

    from qasr.model.config import ModelConfig

    cfg = ModelConfig.from_file(DEMO_MODEL / "config.json").decoder
    with ServerProcess(tmp_path / "serve.log", "--kv-cache-dtype", "int8") as srv:
        with open(ROOT / "examples" / "alarm.flac", "rb") as f:
            r = httpx.post(f"{srv.url}/v1/audio/transcriptions", files={"file": ("alarm.flac", f)},
                           data={"model": "qasr-demo-en"}, timeout=120)
        assert r.status_code == 200 and r.json()["text"] == "set an alarm for seven thirty tomorrow"
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    tokens, nbytes = metric(text, "qasr_engine_kv_tokens_total"), metric(text, "qasr_engine_kv_cache_bytes")
    assert tokens > 0 and nbytes == tokens * kv_bytes_per_token(cfg, torch.float32, "int8")


def test_the_command_lines_take_the_option() -> None:
    import subprocess
    import sys

    from server_proc import DEMO_MODEL, ROOT

    from qasr.cli.main import build_parser
    from qasr.distributed.config import EngineSpec

    parser = build_parser()
    for command in ("transcribe x.wav", "serve"):
        assert parser.parse_args([*command.split(), "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
        assert parser.parse_args(command.split()).kv_cache_dtype == "auto"
    asr = EngineSpec(str(DEMO_MODEL), device="cpu", dtype="float32", kv_cache_dtype="int8").load()
    try:
        assert asr._core.engine.core.pool.k.dtype == torch.int8
    finally:
        asr.close()
    clip = ROOT / "examples" / "alarm.flac"
    out = subprocess.run([sys.executable, "-m", "qasr", "transcribe", str(clip), "-m", str(DEMO_MODEL), "--device",
                          "cpu", "--dtype", "float32", "--kv-cache-dtype", "int8"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "set an alarm for seven thirty tomorrow", out.stderr
    bad = subprocess.run([sys.executable, "-m", "qasr", "transcribe", str(clip), "--kv-cache-dtype", "fp8"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "invalid choice: 'fp8'" in bad.stderr
