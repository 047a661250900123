"""The int8 KV cache's arithmetic (EngineConfig.kv_cache_dtype="int8", docs/engine.md "The int8 KV cache").

Each (token, kv head) row of keys or values is stored as int8 with one float32 scale:
``amax = max |x|``, ``q = round_half_even(x * (127 / amax))`` clamped to [-127, 127], ``scale = amax * (1 / 127)``;
an all-zero row stores zeros with scale 0. A stored value stands for ``q * scale``: the native decode kernel
(bf16, head_dim 128) reads it so in float32, applying a key row's scale to its dot product and a value row's to
its softmax weight; prefill chunks and the torch paths read it rounded to the model's dtype (``dequantize_kv``;
the native ``dequantize_kv_rows`` gives a prefill chunk its sequence's rows so, in one pass).
A row's quantization depends on that row alone: batch invariance and chunk invariance are kept.

``quantize_kv_reference`` is the definition in torch; the native decode kernel's ``quantize_kv`` does the same
arithmetic (tests/engine/test_kv_int8.py checks them bit for bit) and is what the pool uses when the kernel is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from qasr.engine.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "dequantize_kv", "quantize_kv_reference", "quantizer", "row_dequantizer"]
_INV127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)  # float32(1 / 127)


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) int8, scale (...) float32), the arithmetic of the module docstring."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division (``127.0 / amax`` would be torch's reciprocal-then-multiply, two roundings); 127 / 0 = inf
    # is never used
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv).round().clamp(-127, 127).to(torch.int8)
    return q, (amax * _INV127).squeeze(-1)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D) int8 and scale (...) -> the values the model reads, in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantizer(kernel: ModuleType | None) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """The native ``quantize_kv`` where the decode kernel has it, else the torch reference (same bits)."""
    if kernel is not None and hasattr(kernel, "quantize_kv"):
        return kernel.quantize_kv
    return quantize_kv_reference


def row_dequantizer(kernel: ModuleType | None, dtype: torch.dtype) -> Callable[..., None] | None:
    """The native ``dequantize_kv_rows`` (a sequence's rows dequantized into preallocated bf16 or float32
    tensors, padded with zeros; the bits of ``dequantize_kv``) where the decode kernel has it, else None."""
    if kernel is not None and hasattr(kernel, "dequantize_kv_rows") and dtype in (torch.bfloat16, torch.float32):
        return kernel.dequantize_kv_rows
    return None
