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

from qasr.engine.cpu.int4_reference import int4_linear_reference, quantize_weight_groups
from qasr.engine.cpu.int8 import KERNEL_DTYPES


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
