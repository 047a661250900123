"""int8 linears and convolutions on the CPU (``quantize="int8"``): W8A8, dynamic per-row activations.

Weights are quantized once, at preparation, per output channel and symmetric (int8 in [-127, 127] and a
float32 scale per row of W); activations per row on the fly. The product of the int8 values is exact in
int32, and everything else is per element in a fixed order, so a row's result depends only on that row:
any batch, any kernel that follows the arithmetic below gives the same bits (batch invariance for free).

The arithmetic, which every path reproduces bit for bit:

- weight W [N, K]: ``wf = W.float()``, ``w_scale[n] = max_k |wf[n, k]| / 127`` (1.0 for an all-zero row),
  ``w_q = clamp(round_half_even(wf / w_scale[:, None]), -127, 127)``;
- activation row x [K]: ``a_amax = max_k |float32(x[k])|``; ``a_scale = a_amax / 127`` and
  ``inv = 127 / a_amax`` (both 0 when a_amax is 0), ``x_q = clamp(round_half_even(float32(x) * inv), -127, 127)``;
- ``acc = sum_k int32(x_q[k]) * int32(w_q[n, k])``, exact;
- float32, each step one rounding, no fused multiply-add: ``s = a_scale * w_scale[n]``,
  ``y = float32(acc) * s``, ``y = y + bias[n]`` (if any), then ``y`` to x's dtype.

The products run on a native module when one is handed in (``pack(w_q) -> packed`` and ``linear(x, packed,
n, w_scale, bias) -> y``, the same bits), else on the torch reference (int8_reference.py, ``torch._int_mm``). As for the
bf16 kernels, the quantized copies are kept beside the model, keyed by module (quantized_linears.py, which also
fuses linears of one input); the model's own modules are never changed (so its float weights stay in memory
beside the int8 ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.conv import OtherConvs, padded_nhwc

QMAX = 127  # symmetric: -128 is never used, so negating a quantized value never overflows
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes a native int8 module takes
WEIGHT_BLOCK = 1 << 22  # weight values quantized per block (16 MB of float32 temporaries)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (w_q int8 [N, K], w_scale float32 [N]), per output channel.

    In blocks of rows: each row is quantized on its own, so the blocks change nothing, and the float32
    temporaries stay small (a whole 151936 x 1024 LM head in float32 would be 0.6 GB per temporary)."""
    n, k = weight.shape
    w_q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, WEIGHT_BLOCK // max(k, 1))
    for start in range(0, n, step):
        wf = weight[start:start + step].detach().float()
        amax = wf.abs().amax(dim=1)
        # an all-zero row: any scale quantizes it to zeros; 1.0 keeps the division finite
        s = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX)
        w_q[start:start + step] = torch.round(wf / s[:, None]).clamp_(-QMAX, QMAX)
        scale[start:start + step] = s
    return w_q, scale


@dataclass(frozen=True)
class Int8Weight:
    """One layer's quantized weight, ready for the products."""

    packed: torch.Tensor  # the native module's layout, or w_q [N, K] for the torch reference
    scale: torch.Tensor  # float32 [N]
    bias: torch.Tensor | None  # float32 [N]
    n: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType | None) -> Int8Weight:
        w_q, scale = quantize_weight(weight)
        packed = w_q if kernel is None else kernel.pack(w_q)
        return cls(packed, scale, None if bias is None else bias.detach().float(), weight.shape[0])

    def bound(self, kernel: ModuleType | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self.product(x, kernel)`` with the native call's arguments bound now (engine/cpu/decoder_plan.py);
        activations the module does not take still go through ``product``'s checks."""
        if kernel is None:
            return lambda x: self.product(x, None)
        linear, packed, n, scale, bias = kernel.linear, self.packed, self.n, self.scale, self.bias
        return lambda x: linear(x, packed, n, scale, bias) if x.dtype in KERNEL_DTYPES else self.product(x, kernel)

    def product(self, x: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if kernel is not None and x.dtype in KERNEL_DTYPES:
            # straight to the module, which takes any row count (0 included) and makes x contiguous itself: a
            # decode step makes ~200 of these calls, and each Python operation costs microseconds there
            return kernel.linear(x, self.packed, self.n, self.scale, self.bias)
        if kernel is not None:  # the packed layout is the kernel's own: the reference cannot read it
            raise ValueError(f"the native int8 kernel takes float32 or bfloat16 activations, not {x.dtype}")
        if x.shape[0] == 0:
            return x.new_empty(0, self.n)
        return int8_linear_reference(x, self.packed, self.scale, self.bias)


class Int8Convs:
    """``conv(module, x)`` for every nn.Conv2d of a model: the encoder's 3x3 stride-2 480-channel convolutions
    as int8 GEMMs, one row per output position (its kh x kw x cin patch, quantized on its own scale).

    The first convolution (one input channel, so K = 9: each row's scale would rest on nine mel values)
    stays in float: it is memory-bound, costs little, and it is where quantization would lose the most; it
    runs on the native encoder ops when ``ops`` is given (one_channel_conv.py), else on oneDNN with a
    channels-last weight copy, as in conv.py. Convolutions the GEMM form does not cover (groups, dilation,
    other padding modes) run on oneDNN too."""

    def __init__(self, model: nn.Module, kernel: ModuleType | None = None, ops: ModuleType | None = None) -> None:
        self.kernel = kernel
        self.ops = ops  # the native encoder ops: of_gelu's GELU while padding (padded_input.py)
        self.weights: dict[nn.Conv2d, Int8Weight] = {}
        others: list[nn.Conv2d] = []
        for module in model.modules():
            if not isinstance(module, nn.Conv2d):
                continue
            if int8_conv_supported(module):
                # (cout, kh*kw*cin): the feature order of conv.py's weight reshape and of the patches below
                w = module.weight.detach().permute(0, 2, 3, 1).reshape(module.out_channels, -1)
                self.weights[module] = Int8Weight.of(w, module.bias, kernel)
            else:
                others.append(module)
        self.others = OtherConvs(model, others, ops)  # the first convolution, in float (see above)

    def __call__(self, module: nn.Conv2d, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        weight = self.weights.get(module)
        if weight is None:
            return self.others(module, F.gelu(x) if gelu else x)
        n = x.shape[0]
        (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
        xh = padded_nhwc(x, ph, pw, gelu, self.ops)  # (n, h+2ph, w+2pw, cin), zero-padded
        ho, wo = (xh.shape[1] - kh) // sh + 1, (xh.shape[2] - kw) // sw + 1
        if self.kernel is not None and x.dtype in KERNEL_DTYPES:
            # the native module reads each patch in place (the same bits as the explicit rows below): the
            # float im2col copy is 9x the input and cost more than the int8 product it feeds
            out = self.kernel.conv(xh, weight.packed, weight.n, weight.scale, weight.bias, kh, kw, sh, sw)
        else:
            out = weight.product(patch_rows(xh, kh, kw, sh, sw), self.kernel)
        return out.view(n, ho, wo, weight.n).permute(0, 3, 1, 2)  # NCHW shape, NHWC memory, as conv.py's

    def of_gelu(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """``conv(module, F.gelu(x))``."""
        return self(module, x, gelu=True)


def int8_conv_supported(conv: nn.Conv2d) -> bool:
    return (conv.in_channels > 1 and conv.groups == 1 and conv.dilation == (1, 1)
            and isinstance(conv.padding, tuple) and conv.padding_mode == "zeros")


# (int8_reference.py) The W8A8 int8 product in plain torch ops, exactly as the native int8 kernels must compute it
# (their self-test and tests compare against it bit for bit).
#
# Per row m of x: a_amax = max |x|, a_scale = a_amax / 127, inv = 127 / a_amax (both float32 divisions; a zero row
# has a_scale = inv = 0), x_q = clamp(round_half_even(x * inv), -127, 127). Then the exact int32 product with the
# int8 weight w_q [N, K], and a float32 epilogue, one rounding per step and no fused multiply-add: y = float32(acc)
# * (a_scale[m] * w_scale[n]), y = y + bias[n] if there is a bias, out = y in x's dtype.
#
# Two pitfalls of torch 2.13 on CPU this module avoids: torch computes ``127 / t`` (a Python number over a tensor)
# as ``127 * (1 / t)``, two roundings, which differs from a float32 division in about a quarter of the values (a
# tensor over a tensor is a true division); and ``torch._int_mm`` returns wrong sums when K == 1 and N > 1 (K >= 2
# is right), so a K of 1 is padded with a zero column, which adds nothing.

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
