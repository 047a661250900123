"""The convolutions that neither GEMM path (conv.py's bf16, int8.py's int8) takes: the encoder's first one (one
input channel) on the native encoder ops for bf16 when they built (one_channel_conv.py), and every other one (that
one included, without the ops) on oneDNN with a channels-last weight copy, about 20% faster than a contiguous one
on CPUs (the activations follow the weight's layout). Both GEMM paths hand these the same way, so it is here once.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.one_channel_conv import OneChannelConvs


class OtherConvs:
    """``convs(module, x)`` for each of ``modules`` (the model's convolutions a GEMM path leaves): what the module
    computes, on the native first convolution where it applies, else on oneDNN with a channels-last weight."""

    def __init__(self, model: nn.Module, modules: Iterable[nn.Conv2d], ops: ModuleType | None) -> None:
        self.one_channel = OneChannelConvs(model, ops)
        self.channels_last = {m: m.weight.detach().contiguous(memory_format=torch.channels_last) for m in modules}

    def __call__(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        if module in self.one_channel and x.dtype == torch.bfloat16:
            return self.one_channel(module, x)
        weight = self.channels_last.get(module, module.weight)
        return F.conv2d(x, weight, module.bias, module.stride, module.padding, module.dilation, module.groups)
