"""How the model computes its heavy operations, handed in by whoever runs it.

The model's forwards take a ``Kernels`` argument instead of having their modules swapped or attributes
injected from outside: the module tree stays exactly what the checkpoint loaded (so two engines on one
checkpoint never see each other's preparation), and the engine chooses the implementation for its
device in one place (``qasr.engine.device``). The defaults are plain torch ops, the reference maths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def torch_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def torch_conv(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    """``linear(module, x)`` and ``conv(module, x)`` compute what the module would; ``rms_norm(x, weight,
    eps)`` and ``norm_rope(x, weight, cos, sin, eps)`` (RMSNorm, then rotary) replace the decoder's norm
    maths when set; ``dtype`` limits where those two apply (a fused kernel is written for one dtype).
    ``linear_group(modules, x)``, when set, computes several linears of the same input at once (one product
    over their concatenated weights, split by columns); ``linears`` falls back to one call each.
    ``encoder_attention``, when set, replaces the encoder's padded, masked SDPA for bf16 activations (float32
    keeps torch's, the reference maths; see model/encoder.py)."""

    linear: Callable[[nn.Linear, torch.Tensor], torch.Tensor] = torch_linear
    conv: Callable[[nn.Conv2d, torch.Tensor], torch.Tensor] = torch_conv
    rms_norm: Callable[..., torch.Tensor] | None = None
    norm_rope: Callable[..., torch.Tensor] | None = None
    fused_dtype: torch.dtype | None = None
    linear_group: Callable[[tuple[nn.Linear, ...], torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    # ``encoder_attention(q, k, v, windows, scale)``: q/k/v (rows, heads, head_dim), windows (W, 2) int64 (start,
    # length) runs of the rows; each row attends to its window's rows. bf16 activations only
    encoder_attention: Callable[..., torch.Tensor] | None = None
    # ``decoder_layers(x, cos, sin, cache, meta) -> x``, when set, runs all of the decoder's layers: DecoderLayer's
    # ops in the same order on these kernels, with every weight and kernel looked up once (model/decoder.py's
    # BoundDecoderLayers). Built for one model; its kernels never hand it to another
    decoder_layers: Callable[..., torch.Tensor] | None = None
    # ``conv_gelu(module, x)``, when set: ``conv(module, F.gelu(x))`` with the GELU fused into preparing the
    # convolution's input (engine/cpu/conv.py); ``conv_of_gelu`` falls back to the two steps
    conv_gelu: Callable[[nn.Conv2d, torch.Tensor], torch.Tensor] | None = None
    # ``silu_mul(gate, up)``: ``F.silu(gate) * up``; a native form gives the same bits for every result that is not
    # NaN, in one pass (engine/cpu/activation_tables.py)
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch_silu_mul

    def conv_of_gelu(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """``conv(module, F.gelu(x))``."""
        if self.conv_gelu is not None:
            return self.conv_gelu(module, x)
        return self.conv(module, F.gelu(x))

    def fused(self, x: torch.Tensor) -> bool:
        return self.rms_norm is not None and x.dtype == self.fused_dtype

    def linears(self, modules: tuple[nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's ``linear`` of the same ``x`` (the outputs may be column views of one product)."""
        if self.linear_group is not None:
            return self.linear_group(modules, x)
        return tuple(self.linear(m, x) for m in modules)


TORCH_KERNELS = Kernels()
