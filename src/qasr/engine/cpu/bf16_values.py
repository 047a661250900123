"""Every bf16 value, once: what the activation tables (padded_input.gelu_table, silu_mul.silu_table) evaluate torch's
own functions at, so that a native pass can look torch's results up instead of computing them."""

from __future__ import annotations

import numpy as np
import torch


def every_bf16() -> torch.Tensor:
    """(65536,) bfloat16: entry i is the value whose bits are i (NaNs and infinities included)."""
    return torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
