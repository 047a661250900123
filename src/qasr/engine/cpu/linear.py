"""bf16 linear layers on the CPU: every nn.Linear's weight packed once (kept here, keyed by module), products on
qasr's batch-invariant kernel (AMX or AVX512-BF16; native.py), else on oneDNN, which may round a row differently
by batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.model.weights import release_file_pages

log = logging.getLogger(__name__)


class InvariantLinears:
    """``linear(module, x)`` on qasr's row-invariant kernel (odd K, which it cannot pack, uses torch)."""

    def __init__(self, model: nn.Module, kernel: ModuleType) -> None:
        self.kernel = kernel
        self.packed: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor | None]] = {}
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.in_features % 2 == 0]
        # the largest first: its file pages, read while it is packed, then add to the fewest packed copies
        for module in sorted(linears, key=lambda m: -m.weight.numel()):
            bias = None if module.bias is None else module.bias.detach().float()
            self.packed[module] = (kernel.pack(module.weight.detach()), bias)
            release_file_pages(module.weight)  # the packed copy is the one read from now on

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        entry = self.packed.get(module)
        if entry is None:
            return F.linear(x, module.weight, module.bias)
        shape = x.shape
        out = self.kernel.linear(x.reshape(-1, shape[-1]), entry[0], module.out_features, entry[1])
        return out.view(*shape[:-1], module.out_features)

    def bind(self, module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self(module, x)`` for 2-D x, the lookup done now."""
        entry = self.packed.get(module)
        if entry is None:
            return lambda x: self(module, x)
        linear, (packed, bias), n = self.kernel.linear, entry, module.out_features
        return lambda x: linear(x, packed, n, bias)


class OneDnnLinears:
    """``linear(module, x)`` on oneDNN-prepacked weights (fast, not batch-invariant)."""

    def __init__(self, model: nn.Module, batch_hint: int = 64) -> None:
        self.packed: dict[nn.Linear, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                try:
                    self.packed[module] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_hint)
                    release_file_pages(module.weight)
                except RuntimeError as exc:  # an unusual build without the op: plain torch for the rest
                    log.warning("qasr: could not prepack linear weights for oneDNN (%s)", exc)
                    break

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(module)
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, module.bias, "none", [], "")
        return out.view(*shape[:-1], module.out_features)


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
