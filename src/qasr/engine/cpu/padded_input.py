"""The input of the encoder's 3x3 convolutions as their GEMM kernels read it: channels-last, zero-padded, and,
between two convolutions, GELU of the previous one's output.

With the native encoder ops that is one pass over a bf16 activation (``pad_gelu``) instead of torch's three
(gelu; F.pad filling a new tensor with zeros, then copying the interior). Its GELU is a lookup in
``gelu_table()``: torch's own F.gelu evaluated once at each of the 65,536 bf16 values.

Which GELU: torch's bf16 F.gelu is not one function of the value. On a contiguous tensor it runs its vectorized
loop, whose bits do not depend on where a value sits (a partial last vector included: checked for all 65,536
values in tests/test_encoder_ops.py); on a channels-last or strided tensor it takes other loops, which differ
from that in the last bit for ~3% of the values (measured: 53,598 of 1,584,000 at 480 channels). Here GELU is
always the contiguous one: the table, and the torch fallback below, which applies F.gelu to the contiguous
channels-last copy (the padding's copy was made anyway). The plain model (TORCH_KERNELS) applies F.gelu to
torch's contiguous NCHW convolution output: the same bits.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from qasr.engine.cpu.bf16_values import every_bf16


@functools.cache
def gelu_table() -> torch.Tensor:
    """(65536,) int16: entry i holds the bits of F.gelu of the bf16 value whose bits are i."""
    return F.gelu(every_bf16()).view(torch.int16).contiguous()


def padded_nhwc(x: torch.Tensor, ph: int, pw: int, gelu: bool = False, ops: ModuleType | None = None) -> torch.Tensor:
    """(n, c, h, w)-shaped ``x`` (any memory layout) -> (n, h + 2 ph, w + 2 pw, c) contiguous, zeros around
    ``x`` or, with ``gelu``, around its GELU (the contiguous tensor's, see above): in one native pass for bf16
    when ``ops`` (the encoder ops module) is given, else in torch ops (the same bits)."""
    nhwc = x.permute(0, 2, 3, 1)
    if gelu and ops is not None and x.dtype == torch.bfloat16:
        return ops.pad_gelu(nhwc, gelu_table(), ph, pw)
    if gelu:
        nhwc = F.gelu(nhwc.contiguous())  # the contiguous tensor's GELU (see above)
    return F.pad(nhwc, (0, 0, pw, pw, ph, ph)).contiguous()
