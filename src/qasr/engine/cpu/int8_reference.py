"""The W8A8 int8 product in plain torch ops, exactly as the native int8 kernels must compute it (their
self-test and tests compare against it bit for bit).

Per row m of x: a_amax = max |x|, a_scale = a_amax / 127, inv = 127 / a_amax (both float32 divisions; a
zero row has a_scale = inv = 0), x_q = clamp(round_half_even(x * inv), -127, 127). Then the exact int32
product with the int8 weight w_q [N, K], and a float32 epilogue, one rounding per step and no fused
multiply-add: y = float32(acc) * (a_scale[m] * w_scale[n]), y = y + bias[n] if there is a bias, out = y in
x's dtype.

Two pitfalls of torch 2.13 on CPU this module avoids: torch computes ``127 / t`` (a Python number over a
tensor) as ``127 * (1 / t)``, two roundings, which differs from a float32 division in about a quarter of the
values (a tensor over a tensor is a true division); and ``torch._int_mm`` returns wrong sums when K == 1 and
N > 1 (K >= 2 is right), so a K of 1 is padded with a zero column, which adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 or float32) -> (x_q int8 [M, K], a_scale float32 [M]), each row on its own scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    zero = amax == 0
    safe = torch.where(zero, torch.ones_like(amax), amax)  # no division by zero; those rows are zeroed below
    a_scale = torch.where(zero, torch.zeros_like(amax), safe / torch.full_like(amax, 127.0))
    inv = torch.where(zero, torch.zeros_like(amax), torch.full_like(amax, 127.0) / safe)
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, a_scale


def int8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16/float32, w_q int8 [N, K], w_scale float32 [N], bias float32 [N] or None -> [M, N] in
    x's dtype. Also the int8 mode's product where no native kernel runs (engine/cpu/int8.py), hence in place
    where it can be: fewer [M, N] buffers, each op still one rounding in the arithmetic's order."""
    q, a_scale = quantize_rows_reference(x)
    if q.shape[1] == 1:
        q, w_q = F.pad(q, (0, 1)), F.pad(w_q, (0, 1))
    y = torch._int_mm(q, w_q.t()).float()  # int32 [M, N], exact, then float32(acc)
    y.mul_(torch.outer(a_scale, w_scale.float()))  # s = a_scale[m] * w_scale[n], then float32(acc) * s
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)


def patch_rows(xp: torch.Tensor, kh: int, kw: int, sh: int, sw: int) -> torch.Tensor:
    """A padded NHWC input (n, hp, wp, cin) -> its kh x kw patches at stride (sh, sw) as rows
    (n * ho * wo, kh * kw * cin), features in (kh, kw, cin) order: the rows an int8 convolution quantizes
    (the order of the packed weight's K, and of the native modules' ``conv``)."""
    patches = xp.unfold(1, kh, sh).unfold(2, kw, sw)  # (n, ho, wo, cin, kh, kw)
    return patches.permute(0, 1, 2, 4, 5, 3).reshape(-1, kh * kw * xp.shape[3])
