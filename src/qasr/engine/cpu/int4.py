"""int4 decoder weights on the CPU: W4A8, a float32 scale per GROUP input features; the native kernel gives
the torch reference's bits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from qasr.engine.cpu.int8 import KERNEL_DTYPES, quantize_rows_reference
from qasr.model.weights import release_file_pages


@dataclass(frozen=True)
class Int4Weight:
    """The native module's packed tensor (scales inside), or (w_q, scale) for the reference."""

    packed: torch.Tensor | None
    w_q: torch.Tensor | None
    scale: torch.Tensor | None
    bias: torch.Tensor | None  # float32 [N]
    n: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType | None) -> Int4Weight:
        w_q, scale = quantize_weight_groups(weight)
        b = None if bias is None else bias.detach().float()
        if kernel is not None:
            return cls(kernel.pack(w_q, scale), None, None, b, weight.shape[0])
        return cls(None, w_q, scale, b, weight.shape[0])

    def bound(self, kernel: ModuleType | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self.product(x, kernel)``."""
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


GROUP = 128  # input features per weight scale
QMAX4 = 7  # symmetric: -8 is never used


def groups_of(k: int) -> int:
    return -(-k // GROUP)


def quantize_weight_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (w_q int8 [N, K] in [-7, 7], w_scale float32 [N, ceil(K / GROUP)]); W read once, by blocks
    of rows, as in int8.quantize_weight."""
    n, k = weight.shape
    groups = groups_of(k)
    w_q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, groups, dtype=torch.float32)
    step = max(1, (1 << 22) // max(k, 1))
    for start in range(0, n, step):
        wf = F.pad(weight[start:start + step].detach().float(), (0, groups * GROUP - k))
        wf = wf.view(wf.shape[0], groups, GROUP)
        amax = wf.abs().amax(dim=2)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX4)
        q = torch.round(wf / s[:, :, None]).clamp_(-QMAX4, QMAX4).to(torch.int8)
        w_q[start:start + step] = q.view(q.shape[0], -1)[:, :k]
        scale[start:start + step] = s
        release_file_pages(weight[start:start + step])
    return w_q, scale


def int4_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w_q int8 [N, K], w_scale float32 [N, groups], bias float32 [N] -> [M, N] in x's dtype."""
    q, a_scale = quantize_rows_reference(x)
    k = q.shape[1]
    y = torch.zeros(q.shape[0], w_q.shape[0], dtype=torch.float32)
    for g in range(w_scale.shape[1]):
        lo, hi = g * GROUP, min((g + 1) * GROUP, k)
        qa, qw = q[:, lo:hi], w_q[:, lo:hi]
        if hi - lo == 1:  # torch._int_mm is wrong for K == 1
            qa, qw = F.pad(qa, (0, 1)), F.pad(qw, (0, 1))
        t = torch._int_mm(qa.contiguous(), qw.t()).float()
        y.add_(t.mul_(w_scale[:, g].float()))
    y.mul_(a_scale[:, None])
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)
