"""The heavy operations a model forward runs, passed in as ``Kernels`` by whoever runs it.

The module tree stays as loaded (two engines on one checkpoint never share preparation); defaults are torch ops.
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
    """Each field computes what its torch counterpart would; a ``None`` field falls back to torch.
    ``rms_norm(x, weight, eps)`` and ``norm_rope(x, weight, cos, sin, eps)`` apply to ``fused_dtype`` only."""

    linear: Callable[[nn.Linear, torch.Tensor], torch.Tensor] = torch_linear
    conv: Callable[[nn.Conv2d, torch.Tensor], torch.Tensor] = torch_conv
    rms_norm: Callable[..., torch.Tensor] | None = None
    norm_rope: Callable[..., torch.Tensor] | None = None
    fused_dtype: torch.dtype | None = None
    linear_group: Callable[[tuple[nn.Linear, ...], torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    # (q, k, v, windows, scale): q/k/v (rows, heads, head_dim); windows (W, 2) int64 (start, length) row runs
    encoder_attention: Callable[..., torch.Tensor] | None = None
    # (x, cos, sin, cache, meta) -> x: all decoder layers (model/decoder.py's BoundDecoderLayers); one model only
    decoder_layers: Callable[..., torch.Tensor] | None = None
    conv_gelu: Callable[[nn.Conv2d, torch.Tensor], torch.Tensor] | None = None
    # a native form must give torch's bits (NaN aside)
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch_silu_mul

    def conv_of_gelu(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """``conv(module, F.gelu(x))``."""
        if self.conv_gelu is not None:
            return self.conv_gelu(module, x)
        return self.conv(module, F.gelu(x))

    def fused(self, x: torch.Tensor) -> bool:
        return self.rms_norm is not None and x.dtype == self.fused_dtype

    def linears(self, modules: tuple[nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's ``linear`` of ``x``; the outputs may be column views of one product."""
        if self.linear_group is not None:
            return self.linear_group(modules, x)
        return tuple(self.linear(m, x) for m in modules)


TORCH_KERNELS = Kernels()
