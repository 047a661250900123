"""torch's own GELU and SiLU at every bf16 value, as tables the native passes look them up in, and the native
SiLU(gate) * up: torch's bits for every non-NaN result (the table holds F.silu's vectorized loop's NaN bits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from qasr.model.kernels import torch_silu_mul

SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def gelu_table() -> torch.Tensor:
    """(65536,) int16: entry i holds the bits of F.gelu of the bf16 value whose bits are i."""
    return F.gelu(every_bf16()).view(torch.int16).contiguous()


@functools.cache
def silu_table() -> torch.Tensor:
    """(65536,) float32: entry i holds F.silu of the bf16 value whose bits are i (float32: gathered 16 at a time)."""
    return F.silu(every_bf16()).float().contiguous()


def native_silu_mul(ops: ModuleType) -> SiluMul:
    """``(gate, up) -> F.silu(gate) * up``, natively for 2-D bf16 rows."""
    fused, table = ops.silu_mul, silu_table()

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.dtype == torch.bfloat16 and gate.dim() == 2:
            return fused(gate, up, table)
        return torch_silu_mul(gate, up)

    return silu_mul




def every_bf16() -> torch.Tensor:
    """(65536,) bfloat16: entry i is the value whose bits are i."""
    return torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
