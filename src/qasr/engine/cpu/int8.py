"""int8 linears and convolutions on the CPU: W8A8, per-row dynamic activations. Native kernels match the torch
reference below bit for bit; a row depends on no other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.conv import OtherConvs, padded_nhwc
from qasr.model.weights import release_file_pages

QMAX = 127  # symmetric: -128 is never used
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_BLOCK = 1 << 22


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (w_q int8 [N, K], w_scale float32 [N]), per output channel; W read once, by blocks of rows, each
    block's file pages let go once read (model/weights.py: release_file_pages)."""
    n, k = weight.shape
    w_q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, WEIGHT_BLOCK // max(k, 1))
    for start in range(0, n, step):
        wf = weight[start:start + step].detach().float()
        amax = wf.abs().amax(dim=1)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX)
        w_q[start:start + step] = torch.round(wf / s[:, None]).clamp_(-QMAX, QMAX)
        scale[start:start + step] = s
        release_file_pages(weight[start:start + step])
    return w_q, scale


@dataclass(frozen=True)
class Int8Weight:
    packed: torch.Tensor  # the native module's layout, or w_q [N, K]
    scale: torch.Tensor  # float32 [N]
    bias: torch.Tensor | None  # float32 [N]
    n: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType | None) -> Int8Weight:
        w_q, scale = quantize_weight(weight)
        packed = w_q if kernel is None else kernel.pack(w_q)
        return cls(packed, scale, None if bias is None else bias.detach().float(), weight.shape[0])

    def bound(self, kernel: ModuleType | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self.product(x, kernel)``."""
        if kernel is None:
            return lambda x: self.product(x, None)
        linear, packed, n, scale, bias = kernel.linear, self.packed, self.n, self.scale, self.bias
        return lambda x: linear(x, packed, n, scale, bias) if x.dtype in KERNEL_DTYPES else self.product(x, kernel)

    def product(self, x: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if kernel is not None and x.dtype in KERNEL_DTYPES:
            return kernel.linear(x, self.packed, self.n, self.scale, self.bias)
        if kernel is not None:
            raise ValueError(f"the native int8 kernel takes float32 or bfloat16 activations, not {x.dtype}")
        if x.shape[0] == 0:
            return x.new_empty(0, self.n)
        return int8_linear_reference(x, self.packed, self.scale, self.bias)


class Int8Convs:
    """``conv(module, x)`` for every nn.Conv2d: int8 GEMMs where supported, float for the rest."""

    def __init__(self, model: nn.Module, kernel: ModuleType | None = None, ops: ModuleType | None = None) -> None:
        self.kernel = kernel
        self.ops = ops
        self.weights: dict[nn.Conv2d, Int8Weight] = {}
        others: list[nn.Conv2d] = []
        for module in model.modules():
            if not isinstance(module, nn.Conv2d):
                continue
            if int8_conv_supported(module):
                w = module.weight.detach().permute(0, 2, 3, 1).reshape(module.out_channels, -1)
                self.weights[module] = Int8Weight.of(w, module.bias, kernel)
                release_file_pages(module.weight)  # the int8 copy is the one read from now on
            else:
                others.append(module)
        self.others = OtherConvs(model, others, ops)

    def __call__(self, module: nn.Conv2d, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        weight = self.weights.get(module)
        if weight is None:
            return self.others(module, F.gelu(x) if gelu else x)
        n = x.shape[0]
        (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
        xh = padded_nhwc(x, ph, pw, gelu, self.ops)  # (n, h+2ph, w+2pw, cin)
        ho, wo = (xh.shape[1] - kh) // sh + 1, (xh.shape[2] - kw) // sw + 1
        if self.kernel is not None and x.dtype in KERNEL_DTYPES:
            out = self.kernel.conv(xh, weight.packed, weight.n, weight.scale, weight.bias, kh, kw, sh, sw)
        else:
            out = weight.product(patch_rows(xh, kh, kw, sh, sw), self.kernel)
        return out.view(n, ho, wo, weight.n).permute(0, 3, 1, 2)  # NCHW shape, NHWC memory

    def of_gelu(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """``conv(module, F.gelu(x))``."""
        return self(module, x, gelu=True)


def int8_conv_supported(conv: nn.Conv2d) -> bool:
    return (conv.in_channels > 1 and conv.groups == 1 and conv.dilation == (1, 1)
            and isinstance(conv.padding, tuple) and conv.padding_mode == "zeros")


# The reference avoids ``127 / t`` as ``127 * (1 / t)`` (two roundings) and ``torch._int_mm`` with K == 1 (wrong).

def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 or float32) -> (x_q int8 [M, K], a_scale float32 [M])."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    zero = amax == 0
    safe = torch.where(zero, torch.ones_like(amax), amax)
    a_scale = torch.where(zero, torch.zeros_like(amax), safe / torch.full_like(amax, 127.0))
    inv = torch.where(zero, torch.zeros_like(amax), torch.full_like(amax, 127.0) / safe)
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, a_scale


def int8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w_q int8 [N, K], w_scale/bias float32 [N] -> [M, N] in x's dtype."""
    q, a_scale = quantize_rows_reference(x)
    if q.shape[1] == 1:
        q, w_q = F.pad(q, (0, 1)), F.pad(w_q, (0, 1))
    y = torch._int_mm(q, w_q.t()).float()  # exact int32, then float32
    y.mul_(torch.outer(a_scale, w_scale.float()))  # float32(acc) * (a_scale[m] * w_scale[n])
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)


def patch_rows(xp: torch.Tensor, kh: int, kw: int, sh: int, sw: int) -> torch.Tensor:
    """A padded NHWC input -> its kh x kw patches as rows, features in (kh, kw, cin) order."""
    patches = xp.unfold(1, kh, sh).unfold(2, kw, sw)  # (n, ho, wo, cin, kh, kw)
    return patches.permute(0, 1, 2, 4, 5, 3).reshape(-1, kh * kw * xp.shape[3])
