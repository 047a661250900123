"""SiLU(gate) * up, the decoder MLP's step between its two products, in one native pass for bf16.

In torch it is two passes and a temporary (F.silu, then the product); with the decoder ops module it is one
(``silu_mul`` in decoder_ops.cpp), whose SiLU is a lookup in ``silu_table()``: torch's own F.silu evaluated once at
each of the 65,536 bf16 values, so it is torch's function by construction, in any torch version.

Which SiLU: torch's bf16 F.silu runs a vectorized loop over each contiguous run of a tensor and a scalar loop over
a run's last values when the run is not a whole number of vectors. The two agree on every value whose result is
a number; where the result is NaN (a NaN input, or -inf, whose SiLU is -inf * 0) they give different NaN bits
(0xFFFF and 0x7FC0), and the table holds the vectorized loop's. So the native pass gives torch's bits for every
result that is not NaN, and NaN where torch gives NaN (tests/engine/cpu/test_silu_mul.py checks all 65,536 values).
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
    """(65536,) float32: entry i holds F.silu of the bf16 value whose bits are i (a bf16 value, exact in float32;
    float32 so that the native pass gathers 16 entries at a time)."""
    return F.silu(every_bf16()).float().contiguous()


def native_silu_mul(ops: ModuleType) -> SiluMul:
    """``(gate, up) -> F.silu(gate) * up`` on the decoder ops module for 2-D bf16 rows, torch's ops otherwise."""
    fused, table = ops.silu_mul, silu_table()

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.dtype == torch.bfloat16 and gate.dim() == 2:
            return fused(gate, up, table)
        return torch_silu_mul(gate, up)

    return silu_mul


# (bf16_values.py) Every bf16 value, once: what the activation tables (padded_input.gelu_table, silu_mul.silu_table)
# evaluate torch's own functions at, so that a native pass can look torch's results up instead of computing them.


def every_bf16() -> torch.Tensor:
    """(65536,) bfloat16: entry i is the value whose bits are i (NaNs and infinities included)."""
    return torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
