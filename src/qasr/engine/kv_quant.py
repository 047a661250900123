"""The int8 KV cache's arithmetic, per (token, kv head) row: ``q = round_half_even(x * (127 / amax))``
clamped to +-127, ``scale = amax * (1 / 127)`` (0 for a zero row), read as ``q * scale``. The native kernels
give the same bits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from qasr.engine.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "dequantize_kv", "quantize_kv_reference", "quantizer", "row_dequantizer"]
_INV127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)  # float32(1 / 127)


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) int8, scale (...) float32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division: ``127.0 / amax`` would be a reciprocal, then a product (two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv).round().clamp(-127, 127).to(torch.int8)
    return q, (amax * _INV127).squeeze(-1)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D) int8 and scale (...) -> the values read, in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantizer(kernel: ModuleType | None) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """The native ``quantize_kv`` where the decode kernel has it, else the torch reference."""
    if kernel is not None and hasattr(kernel, "quantize_kv"):
        return kernel.quantize_kv
    return quantize_kv_reference


def row_dequantizer(kernel: ModuleType | None, dtype: torch.dtype) -> Callable[..., None] | None:
    """The native ``dequantize_kv_rows`` where the decode kernel has it for ``dtype``, else None."""
    if kernel is not None and hasattr(kernel, "dequantize_kv_rows") and dtype in (torch.bfloat16, torch.float32):
        return kernel.dequantize_kv_rows
    return None
