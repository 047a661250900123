"""int4 decoder weights on the CPU (``quantize="int4"``): the decoder's linears and the LM head in W4A8, the
encoder as in the int8 mode.

Why the decoder only: a decode step reads every decoder weight once for a few rows, so its time is the weights'
bytes over the memory bandwidth, and int4 halves int8's bytes (measured: the 0.6B decoder's linears at one
row, 12 ms a step against 24 ms in int8 and 42 ms in bf16). The encoder is compute-bound and reads its weights
for hundreds of rows at a time: int4 would only cost it accuracy, so it keeps int8's W8A8.

The arithmetic (int4_reference.py): weights quantized once per output channel and per group of 128 input
features (symmetric, [-7, 7], float32 scales); activations per row as in the int8 mode; exact int32 sums per
group, added in float32 in group order. A row's result depends only on that row (batch invariance), on the
native AVX512-VNNI kernel (csrc/int4_linear.cpp) and on the torch reference alike (the same bits). As for
the other prepared kernels, the model's modules are never changed: quantized_linears.py keeps the copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from qasr.engine.cpu.int8 import KERNEL_DTYPES, quantize_rows_reference


@dataclass(frozen=True)
class Int4Weight:
    """One layer's int4 weight, ready for the products: the native module's packed tensor (scales inside), or
    (w_q, w_scale) for the torch reference."""

    packed: torch.Tensor | None
    w_q: torch.Tensor | None
    scale: torch.Tensor | None
    bias: torch.Tensor | None  # float32 [N]
    n: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType | None) -> Int4Weight:
        w_q, scale = quantize_weight_groups(weight)
        b = None if bias is None else bias.detach().float()
        if kernel is not None:  # the packed tensor holds both: the unpacked copies are dropped
            return cls(kernel.pack(w_q, scale), None, None, b, weight.shape[0])
        return cls(None, w_q, scale, b, weight.shape[0])

    def bound(self, kernel: ModuleType | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self.product(x, kernel)`` with the native call's arguments bound now (engine/cpu/decoder_plan.py);
        activations the module does not take still go through ``product``'s checks."""
        if self.packed is None or kernel is None:
            return lambda x: self.product(x, kernel)
        linear, packed, n, bias = kernel.linear, self.packed, self.n, self.bias
        return lambda x: linear(x, packed, n, bias) if x.dtype in KERNEL_DTYPES else self.product(x, kernel)

    def product(self, x: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.packed is not None:
            if kernel is None or x.dtype not in KERNEL_DTYPES:
                raise ValueError(f"the native int4 kernel takes float32 or bfloat16 activations, not {x.dtype}")
            return kernel.linear(x, self.packed, self.n, self.bias)
        assert self.w_q is not None and self.scale is not None
        if x.shape[0] == 0:
            return x.new_empty(0, self.n)
        return int4_linear_reference(x, self.w_q, self.scale, self.bias)


# (int4_reference.py) The W4A8 product of ``quantize="int4"`` in plain torch ops, exactly as the native int4 kernel
# (csrc/int4_linear.cpp) must compute it; its self-test and tests compare against this bit for bit.
#
# Weights in groups of ``GROUP`` input features: per output channel n and group g, ``w_scale[n, g] = max |w| / 7``
# (1.0 for an all-zero group) and ``w_q = clamp(round_half_even(w / w_scale), -7, 7)``. Activations: the int8 mode's
# per-row quantization (int8_reference.py). Per group the exact int32 sum ``acc_g = sum x_q * w_q``; then in
# float32, one rounding per step and no fused multiply-add: ``y = 0``, ``y = y + float32(acc_g) * w_scale[n, g]``
# for g = 0, 1, ... in order, ``y = y * a_scale[m]``, ``y = y + bias[n]`` if any, and ``y`` to x's dtype.

GROUP = 128  # input features per weight scale
QMAX4 = 7  # symmetric: -8 is never used


def groups_of(k: int) -> int:
    return -(-k // GROUP)


def quantize_weight_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (w_q int8 [N, K] in [-7, 7], w_scale float32 [N, ceil(K / GROUP)]).
    The last group of a K that is not a multiple of GROUP is shorter (its scale is its own values')."""
    n, k = weight.shape
    groups = groups_of(k)
    w_q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, groups, dtype=torch.float32)
    step = max(1, (1 << 22) // max(k, 1))  # rows per block: small float32 temporaries (the LM head is 151936 rows)
    for start in range(0, n, step):
        wf = F.pad(weight[start:start + step].detach().float(), (0, groups * GROUP - k))
        wf = wf.view(wf.shape[0], groups, GROUP)
        amax = wf.abs().amax(dim=2)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX4)
        q = torch.round(wf / s[:, :, None]).clamp_(-QMAX4, QMAX4).to(torch.int8)
        w_q[start:start + step] = q.view(q.shape[0], -1)[:, :k]
        scale[start:start + step] = s
    return w_q, scale


def int4_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16/float32, w_q int8 [N, K] in [-7, 7], w_scale float32 [N, groups], bias float32 [N] or None
    -> [M, N] in x's dtype."""
    q, a_scale = quantize_rows_reference(x)
    k = q.shape[1]
    y = torch.zeros(q.shape[0], w_q.shape[0], dtype=torch.float32)
    for g in range(w_scale.shape[1]):
        lo, hi = g * GROUP, min((g + 1) * GROUP, k)
        qa, qw = q[:, lo:hi], w_q[:, lo:hi]
        if hi - lo == 1:  # torch._int_mm is wrong for K == 1 (int8_reference.py): a zero column adds nothing
            qa, qw = F.pad(qa, (0, 1)), F.pad(qw, (0, 1))
        t = torch._int_mm(qa.contiguous(), qw.t()).float()  # exact int32, then float32(acc_g)
        y.add_(t.mul_(w_scale[:, g].float()))
    y.mul_(a_scale[:, None])
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)
