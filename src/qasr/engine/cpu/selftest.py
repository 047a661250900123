"""Self-tests of a native kernel at its first load, against torch references; a kernel that fails is disabled
with one warning, and the engine uses the next kernel or plain torch."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from qasr.engine.cpu.int4 import GROUP, int4_linear_reference
from qasr.engine.cpu.int8 import int8_linear_reference, patch_rows, quantize_rows_reference
from qasr.model.decoder import RMSNorm, rotate_half

log = logging.getLogger(__name__)

timings: dict[str, float] = {}


class SelfTestFailure(AssertionError):
    pass


def verified(name: str, module: ModuleType | None, check: Callable[[ModuleType], None]) -> ModuleType | None:
    """``module`` if ``check(module)`` passes, else None with one warning."""
    if module is None:
        return None
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            check(module)
    except Exception as exc:  # any failure disqualifies
        log.warning("qasr: native kernel %r failed its self-test on this CPU and is disabled: %s: %s",
                    name, type(exc).__name__, exc)
        return None
    timings[name] = time.perf_counter() - start
    log.debug("qasr: native kernel %r passed its self-test in %.1f ms", name, 1e3 * timings[name])
    return module


def check_gemm(kernel: ModuleType) -> None:
    """pack / linear / conv near float32 products; rows independent of their call."""
    gen = torch.Generator().manual_seed(20261130)
    for k, n, has_bias in ((96, 130, True), (70, 67, False), (2, 17, True)):
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen) if has_bias else None
        x = torch.randn(37, k, generator=gen).to(torch.bfloat16)
        packed = kernel.pack(w)
        got = kernel.linear(x, packed, n, bias)
        ref = x.float() @ w.float().T + (bias if bias is not None else 0)
        scale = x.float().abs() @ w.float().abs().T + (bias.abs() if bias is not None else 0)
        _expect_close(f"linear K={k} N={n}", got, ref, scale)
        rows_alone = functools.partial(_linear_rows, kernel, x, packed, n, bias)
        _expect_row_invariant(f"linear K={k} N={n}", got, rows_alone)
    _check_conv(kernel, gen)


def _linear_rows(kernel: ModuleType, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                 rows: slice) -> torch.Tensor:
    return kernel.linear(x[rows], packed, n, bias)


def _check_conv(kernel: ModuleType, gen: torch.Generator) -> None:
    n, hp, wp, cin, cout = 3, 7, 9, 6, 70
    xp = torch.randn(n, hp, wp, cin, generator=gen).to(torch.bfloat16)
    w = torch.randn(cout, cin, 3, 3, generator=gen).to(torch.bfloat16)
    bias = torch.randn(cout, generator=gen)
    packed = kernel.pack(w.permute(0, 2, 3, 1).reshape(cout, -1).contiguous())
    got = kernel.conv(xp, packed, cout, bias, 3, 3, 2, 1)
    nchw = xp.float().permute(0, 3, 1, 2)
    ref = F.conv2d(nchw, w.float(), bias, stride=(2, 1)).permute(0, 2, 3, 1).reshape(-1, cout)
    scale = F.conv2d(nchw.abs(), w.float().abs(), bias.abs(), stride=(2, 1)).permute(0, 2, 3, 1).reshape(-1, cout)
    _expect_close("conv 3x3 cin=6 cout=70", got, ref, scale)
    alone = kernel.conv(xp[1:2].contiguous(), packed, cout, bias, 3, 3, 2, 1)
    if not torch.equal(alone, got[21:42]):
        raise SelfTestFailure("conv: an image alone differs from the same image in a batch of 3")


def _expect_close(what: str, got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """Within one bf16 rounding plus 2^-12 of the sum of |products| (summation order)."""
    if got.shape != ref.shape or got.dtype != torch.bfloat16:
        raise SelfTestFailure(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(ref.shape)} bfloat16")
    err = (got.float() - ref).abs()
    ok = err <= 2 ** -8 * ref.abs() + 2 ** -12 * scale
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise SelfTestFailure(f"{what}: {int((~ok).sum())} of {ok.numel()} values off, first at {bad}: "
                              f"{got[tuple(bad)].item()} vs {ref[tuple(bad)].item():.6g}")


def _expect_row_invariant(what: str, full: torch.Tensor, call: Callable[[slice], torch.Tensor]) -> None:
    for rows in (slice(0, 1), slice(17, 18), slice(36, 37), slice(0, 5), slice(14, 19), slice(32, 37)):
        if not torch.equal(call(rows), full[rows]):
            raise SelfTestFailure(f"{what}: rows {rows.start}..{rows.stop - 1} alone differ from a 37-row call")


def check_int8_gemm(kernel: ModuleType) -> None:
    """pack / quantize_rows / linear / conv give the int8 torch reference's bits."""
    gen = torch.Generator().manual_seed(20261202)
    for i, (k, n) in enumerate((k, n) for k in (1, 3, 65, 1000) for n in (1, 17, 300)):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w_scale = torch.rand(n, generator=gen) * 0.02 + 1e-4
        bias = torch.randn(n, generator=gen) if i % 3 != 2 else None
        x = torch.randn(300, k, generator=gen) * torch.exp(6 * torch.rand(300, 1, generator=gen) - 3)
        x[7] = 0
        x = x.to(dtype)
        what = f"int8 linear M=300 K={k} N={n} {dtype} {'bias' if bias is not None else 'no bias'}"
        packed = kernel.pack(w_q)
        q, a_scale = kernel.quantize_rows(x)
        q_ref, a_scale_ref = quantize_rows_reference(x)
        if not (torch.equal(q, q_ref) and torch.equal(a_scale, a_scale_ref)):
            raise SelfTestFailure(f"quantize_rows K={k} {dtype}: differs from the reference")
        _expect_exact_rows(what, lambda rows: kernel.linear(rows, packed, n, w_scale, bias), x,  # noqa: B023
                           int8_linear_reference(x, w_q, w_scale, bias))
    _check_int8_conv(kernel, gen)


def check_int4_gemm(kernel: ModuleType) -> None:
    """pack / linear give the int4 torch reference's bits."""
    gen = torch.Generator().manual_seed(20261203)
    for i, (k, n) in enumerate((k, n) for k in (1, 3, 129, 1000) for n in (1, 17, 300)):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        w_q = torch.randint(-7, 8, (n, k), generator=gen, dtype=torch.int8)
        w_q[0, :GROUP] = 0
        groups = -(-k // GROUP)
        w_scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-4
        bias = torch.randn(n, generator=gen) if i % 3 != 2 else None
        x = torch.randn(300, k, generator=gen) * torch.exp(6 * torch.rand(300, 1, generator=gen) - 3)
        x[7] = 0
        x = x.to(dtype)
        what = f"int4 linear M=300 K={k} N={n} {dtype} {'bias' if bias is not None else 'no bias'}"
        packed = kernel.pack(w_q, w_scale)
        _expect_exact_rows(what, lambda rows: kernel.linear(rows, packed, n, bias), x,  # noqa: B023
                           int4_linear_reference(x, w_q, w_scale, bias))


def _expect_exact_rows(what: str, linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       ref: torch.Tensor) -> None:
    full = linear(x)
    if full.dtype != x.dtype or full.shape != ref.shape:
        raise SelfTestFailure(f"{what}: got {tuple(full.shape)} {full.dtype}, want {tuple(ref.shape)} {x.dtype}")
    if not torch.equal(full, ref):
        bad = (full != ref).nonzero()
        first = tuple(bad[0].tolist())
        raise SelfTestFailure(f"{what}: {len(bad)} of {ref.numel()} values differ from the reference, first "
                              f"at {first}: {full[first].item()} vs {ref[first].item()}")
    for rows in (slice(299, 300), slice(6, 8), slice(150, 167)):
        if not torch.equal(linear(x[rows]), full[rows]):
            raise SelfTestFailure(f"{what}: rows {rows.start}..{rows.stop - 1} alone differ from a 300-row call")


def _check_int8_conv(kernel: ModuleType, gen: torch.Generator) -> None:
    cin, cout = 37, 70
    w_q = torch.randint(-127, 128, (cout, 3 * 3 * cin), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(cout, generator=gen) * 0.02 + 1e-4
    bias = torch.randn(cout, generator=gen)
    packed = kernel.pack(w_q)
    for dtype in (torch.float32, torch.bfloat16):
        xp = (torch.randn(3, 9, 8, cin, generator=gen) * torch.exp(4 * torch.rand(3, 9, 1, 1, generator=gen) - 2))
        xp = xp.to(dtype)
        got = kernel.conv(xp, packed, cout, w_scale, bias, 3, 3, 2, 1)
        ref = int8_linear_reference(patch_rows(xp, 3, 3, 2, 1), w_q, w_scale, bias)
        if got.dtype != dtype or not torch.equal(got, ref):
            raise SelfTestFailure(f"int8 conv 3x3 stride (2, 1) cin={cin} {dtype}: differs from the im2col reference")


def scattered_pool(kv_heads: int, blocks: int, block_size: int, d: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value pools full of NaN, so a read of an unowned row shows."""
    shape = (kv_heads, blocks * block_size, d)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


def positions(table: list[int], block_size: int, n: int) -> torch.Tensor:
    """Pool rows of positions [0, n) under this block table."""
    pos = torch.arange(n)
    return torch.tensor(table)[pos // block_size] * block_size + pos % block_size


def fill(pool: torch.Tensor, rows: torch.Tensor, gen: torch.Generator) -> None:
    pool[:, rows] = torch.randn(pool.shape[0], len(rows), pool.shape[2], generator=gen).to(pool.dtype)


def check_prefill_attention(kernel: ModuleType) -> None:
    """A chunk after cached tokens in scattered blocks, near float32 attention."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, heads, d, bs, ctx, n = 2, 4, 128, 16, 70, 9
    table = [7, 2, 9, 0, 5]
    kpool, vpool = scattered_pool(kv_heads, 11, bs, d, torch.bfloat16)
    rows = positions(table, bs, ctx + n)
    fill(kpool, rows, gen)
    fill(vpool, rows, gen)
    q = torch.randn(n, heads, d, generator=gen).to(torch.bfloat16)
    scale = d ** -0.5
    tab = torch.tensor(table)
    got = kernel.prefill_attention(q, kpool, vpool, tab, bs, ctx, scale)
    keys, values = kpool[:, rows].float()[None], vpool[:, rows].float()[None]
    causal = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n)[:, None])
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values, attn_mask=causal,
                                         scale=scale, enable_gqa=True)[0].transpose(0, 1)
    _expect_near("prefill attention", got, ref, 1.5e-2)
    tail = kernel.prefill_attention(q[6:].contiguous(), kpool, vpool, tab, bs, ctx + 6, scale)
    if not torch.equal(tail, got[6:]):
        raise SelfTestFailure("prefill attention: the last 3 queries alone differ from the whole chunk")
    # the table changes where, never what, is read
    kc, vc = scattered_pool(kv_heads, 11, bs, d, torch.bfloat16)
    kc[:, 16:16 + ctx + n], vc[:, 16:16 + ctx + n] = kpool[:, rows], vpool[:, rows]
    if not torch.equal(kernel.prefill_attention(q, kc, vc, torch.arange(1, 6), bs, ctx, scale), got):
        raise SelfTestFailure("prefill attention: consecutive blocks give other bits than scattered ones")


def check_decode_attention(kernel: ModuleType) -> None:
    """One query per sequence near float32 attention; new key/value stored."""
    gen = torch.Generator().manual_seed(11)
    bs = 16
    tables = [[3], [12, 1, 7, 4, 10], [6, 0, 9]]
    lens = torch.tensor([1, 70, 33])
    tabs = torch.tensor([t + [0] * (5 - len(t)) for t in tables])
    for dtype, d, tol in ((torch.bfloat16, 128, 1e-2), (torch.float32, 64, 1e-4)):
        kv_heads, heads = 2, 4
        kpool, vpool = scattered_pool(kv_heads, 14, bs, d, dtype)
        rows = [positions(t, bs, int(m)) for t, m in zip(tables, lens, strict=True)]
        for r in rows:
            fill(kpool, r[:-1], gen)
            fill(vpool, r[:-1], gen)
        q = torch.randn(3, heads, d, generator=gen).to(dtype)
        k_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
        v_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
        scale = d ** -0.5
        got = kernel.decode_attention(q, kpool, vpool, tabs, lens, bs, scale, k_new, v_new)
        last = torch.stack([r[-1] for r in rows])
        stored = (torch.equal(kpool[:, last], k_new.transpose(0, 1))
                  and torch.equal(vpool[:, last], v_new.transpose(0, 1)))
        if not stored:
            raise SelfTestFailure(f"decode attention {dtype}: new keys/values not stored at the last position")
        ref = torch.stack([
            F.scaled_dot_product_attention(q[b].float()[None, :, None], kpool[:, r].float()[None],
                                           vpool[:, r].float()[None], scale=scale, enable_gqa=True)[0, :, 0]
            for b, r in enumerate(rows)])
        _expect_near(f"decode attention {dtype} d={d}", got, ref, tol)
        one = kernel.decode_attention(q[1:2].contiguous(), kpool, vpool, tabs[1:2], lens[1:2], bs, scale)
        if not torch.equal(one[0], got[1]):
            raise SelfTestFailure(f"decode attention {dtype}: a sequence alone differs from it in a batch")
    check_decode_attention_int8(kernel, tables, tabs, lens, bs)


def check_decode_attention_int8(kernel: ModuleType, tables: list[list[int]], tabs: torch.Tensor, lens: torch.Tensor,
                                bs: int) -> None:
    """The int8 pool's ops (engine/kv_cache.py) against the torch definitions."""
    from qasr.engine.kv_cache import dequantize_kv, quantize_kv_reference

    gen = torch.Generator().manual_seed(12)
    for dtype, d, tol in ((torch.bfloat16, 128, 1e-2), (torch.bfloat16, 64, 1e-2), (torch.float32, 64, 1e-4)):
        kv_heads, heads, blocks = 2, 4, 14
        x = (torch.randn(6, kv_heads, d, generator=gen) * 4).to(dtype)
        x[2, 1] = 0
        q8, s8 = kernel.quantize_kv(x)
        want_q, want_s = quantize_kv_reference(x)
        if not (torch.equal(q8, want_q) and torch.equal(s8, want_s)):
            raise SelfTestFailure(f"quantize_kv {dtype}: differs from the torch definition")
        pool, scales = torch.zeros(kv_heads, 20, d, dtype=torch.int8), torch.full((kv_heads, 20), -1.0)
        at = torch.tensor([17, 3, 4, 11, 0, 19])
        kernel.store_kv_int8(x, pool, scales, at)
        want_pool, want_scales = torch.zeros_like(pool), torch.full_like(scales, -1.0)
        want_pool[:, at], want_scales[:, at] = want_q.transpose(0, 1), want_s.T
        if not (torch.equal(pool, want_pool) and torch.equal(scales, want_scales)):
            raise SelfTestFailure(f"store_kv_int8 {dtype}: not quantize_kv's rows at the rows asked")
        shape = (kv_heads, blocks * bs, d)
        kq = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        vq = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        ks, vs = torch.rand(shape[:2], generator=gen) / 20, torch.rand(shape[:2], generator=gen) / 20
        q = torch.randn(3, heads, d, generator=gen).to(dtype)
        k_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
        v_new = torch.randn(3, kv_heads, d, generator=gen).to(dtype)
        scale = d ** -0.5
        got = kernel.decode_attention_int8(q, kq, vq, ks, vs, tabs, lens, bs, scale, k_new, v_new)
        rows = [positions(t, bs, int(m)) for t, m in zip(tables, lens, strict=True)]
        last = torch.stack([r[-1] for r in rows])
        for pool, scales, new in ((kq, ks, k_new), (vq, vs, v_new)):
            nq, ns = quantize_kv_reference(new)
            if not (torch.equal(pool[:, last], nq.transpose(0, 1)) and torch.equal(scales[:, last], ns.T)):
                raise SelfTestFailure(f"decode attention int8 {dtype}: new rows not stored quantized")
        # the portable path rounds float(q) * scale to the dtype
        read_as = torch.float32 if d == 128 else dtype
        kf, vf = dequantize_kv(kq, ks, read_as).float(), dequantize_kv(vq, vs, read_as).float()
        ref = torch.stack([
            F.scaled_dot_product_attention(q[b].float()[None, :, None], kf[:, r][None], vf[:, r][None], scale=scale,
                                           enable_gqa=True)[0, :, 0]
            for b, r in enumerate(rows)])
        _expect_near(f"decode attention int8 {dtype} d={d}", got, ref, tol)
        one = kernel.decode_attention_int8(q[1:2].contiguous(), kq, vq, ks, vs, tabs[1:2], lens[1:2], bs, scale)
        if not torch.equal(one[0], got[1]):
            raise SelfTestFailure(f"decode attention int8 {dtype}: a sequence alone differs from it in a batch")
        seq = rows[1]
        length = -(-len(seq) // bs) * bs + bs
        out_k, out_v = torch.empty(kv_heads, length, d, dtype=dtype), torch.empty(kv_heads, length, d, dtype=dtype)
        kernel.dequantize_kv_rows(kq, vq, ks, vs, seq, out_k, out_v)
        for out, pool, scales in ((out_k, kq, ks), (out_v, vq, vs)):
            want = F.pad(dequantize_kv(pool[:, seq], scales[:, seq], dtype), (0, 0, 0, length - len(seq)))
            if not torch.equal(out, want):
                raise SelfTestFailure(f"dequantize_kv_rows {dtype} d={d}: differs from dequantize_kv")

def check_encoder_attention(kernel: ModuleType) -> None:
    """Windows near float32 SDPA; a window alone as among others."""
    gen = torch.Generator().manual_seed(17)
    windows = torch.tensor([[0, 104], [104, 13], [117, 1]])
    for dtype, d, tol in ((torch.bfloat16, 64, 1e-2), (torch.float32, 64, 1e-4), (torch.bfloat16, 48, 1e-2)):
        q, k, v = (torch.randn(118, 4, d, generator=gen).to(dtype) for _ in range(3))
        got = kernel.encoder_attention(q, k, v, windows, 0.125)
        ref = torch.cat([F.scaled_dot_product_attention(*(t[s:s + n].float().transpose(0, 1) for t in (q, k, v)),
                                                        scale=0.125).transpose(0, 1) for s, n in windows.tolist()])
        _expect_near(f"encoder attention {dtype} d={d}", got, ref, tol)
        one = kernel.encoder_attention(q[104:117], k[104:117], v[104:117], torch.tensor([[0, 13]]), 0.125)
        if not torch.equal(one, got[104:117]):
            raise SelfTestFailure(f"encoder attention {dtype}: a window alone differs from it among others")


def check_decoder_ops(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    eps = 1e-6

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        norm = RMSNorm(w.shape[0], eps).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(w)
            return norm(x)

    x = (3 * torch.randn(5, 96, generator=gen)).to(torch.bfloat16)
    w = torch.randn(96, generator=gen).to(torch.bfloat16)
    _expect_bf16_steps("rms_norm", kernel.rms_norm(x, w, eps), rms(x, w))
    n, heads, d = 3, 2, 128
    x = torch.randn(n, heads, d, generator=gen).to(torch.bfloat16)
    w = torch.randn(d, generator=gen).to(torch.bfloat16)
    angles = torch.rand(n, 1, d // 2, generator=gen) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    y = rms(x, w)
    _expect_bf16_steps("norm_rope", kernel.norm_rope(x, w, cos, sin, eps), y * cos + rotate_half(y) * sin)
    check_silu_mul(kernel)
    check_float_decoder_ops(kernel)


def check_silu_mul(kernel: ModuleType) -> None:
    from qasr.engine.cpu.activation_tables import silu_table

    gen = torch.Generator().manual_seed(7)
    z = (4 * torch.randn(5, 80, generator=gen)).to(torch.bfloat16)
    z[0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    gate, up = z[:, :40], z[:, 40:]
    got, want = kernel.silu_mul(gate, up, silu_table()), F.silu(gate) * up
    if got.shape != want.shape or got.dtype != torch.bfloat16:
        raise SelfTestFailure(f"silu_mul: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} bfloat16")
    differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    if differ:
        raise SelfTestFailure(f"silu_mul: {differ} of {want.numel()} values differ from F.silu(gate) * up")


def check_encoder_ops(kernel: ModuleType) -> None:
    from qasr.engine.cpu.activation_tables import gelu_table

    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 6, 5, 34, generator=gen) * 4).to(torch.bfloat16)
    x[0, 1, 2, :3] = torch.tensor([0.0, -0.0, float("nan")])
    x[1, 0, 0, :2] = torch.tensor([300.0, -300.0])
    for src in (x, x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)):
        for ph, pw in ((1, 1), (2, 0), (0, 0)):
            got = kernel.pad_gelu(src, gelu_table(), ph, pw)
            want = F.pad(F.gelu(src.contiguous()), (0, 0, pw, pw, ph, ph))
            same = got.view(torch.int16) == want.view(torch.int16)
            if not (got.is_contiguous() and bool((same | (got.isnan() & want.isnan())).all())):
                raise SelfTestFailure(f"pad_gelu (padding {ph}, {pw}): differs from F.pad(F.gelu(x))")
    for (kh, kw, sh, sw, ph, pw), has_bias in (((3, 3, 2, 2, 1, 1), True), ((2, 3, 1, 2, 0, 1), False)):
        img = (torch.randn(3, 1, 11, 8, generator=gen) * 3).to(torch.bfloat16)
        w = (torch.randn(40, 1, kh, kw, generator=gen) / 3).to(torch.bfloat16)
        b = torch.randn(40, generator=gen).to(torch.bfloat16) if has_bias else None
        taps = w.float().reshape(40, -1).t().contiguous()
        got = kernel.conv_one_channel(img, taps, None if b is None else b.float(), kh, kw, sh, sw, ph, pw)
        ref = F.conv2d(img.float(), w.float(), None if b is None else b.float(), (sh, sw), (ph, pw)).permute(0, 2, 3, 1)
        step = ref.abs().clamp_min(2.0 ** -120) * 2.0 ** -7
        if got.shape != ref.shape or not bool(((got.float() - ref).abs() <= step).all()):
            raise SelfTestFailure(f"conv_one_channel {kh}x{kw}: off the float32 convolution by more than a bf16 step")
        alone = kernel.conv_one_channel(img[1:2], taps, None if b is None else b.float(), kh, kw, sh, sw, ph, pw)
        if not torch.equal(alone[0], got[1]):
            raise SelfTestFailure("conv_one_channel: an image alone differs from it in a batch")


def check_float_decoder_ops(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.float16):
        norm = RMSNorm(64, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=gen))
        x = (3 * torch.randn(5, 4, 64, generator=gen)).to(dtype)
        emb = torch.rand(5, 1, 32, generator=gen).repeat(1, 1, 2) * 50
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        with torch.no_grad():
            y = norm(x)
            pairs = (("rms_norm_ops", kernel.rms_norm_ops(x, norm.weight, norm.eps), y),
                     ("norm_rope_ops", kernel.norm_rope_ops(x, norm.weight, cos, sin, norm.eps),
                      y * cos + rotate_half(y) * sin))
        for what, got, want in pairs:
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise SelfTestFailure(f"{what} {dtype}: not the bits of the torch ops it stands for")


def _expect_near(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    if got.shape != ref.shape or not bool(torch.isfinite(got).all()):
        raise SelfTestFailure(f"{what}: shape {tuple(got.shape)} (want {tuple(ref.shape)}) or non-finite values")
    err = (got.float() - ref).abs().max().item()
    if not torch.allclose(got.float(), ref, atol=tol, rtol=tol):
        raise SelfTestFailure(f"{what}: max error {err:.3g} over the tolerance {tol}")


def _expect_bf16_steps(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    # the sum of squares may be added in another order
    if got.shape != ref.shape or got.dtype != torch.bfloat16:
        raise SelfTestFailure(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(ref.shape)} bfloat16")
    tol = 2 ** -7
    if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item()):
        raise SelfTestFailure(f"{what}: max error {(got.float() - ref.float()).abs().max().item():.3g}")
