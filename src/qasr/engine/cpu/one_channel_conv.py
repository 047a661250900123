"""The encoder's first convolution (one input channel: the log-mel image) on the native encoder ops.

oneDNN ran it at 4-20 ms per 8 one-second chunks on two Zen 4 cores, its speed moving between processes with the
strides of the weight and the input, and wrote its output channels-first, which the next convolution's padding
then transposed (25 MB per 8 chunks). ``conv_one_channel`` (encoder_ops.cpp) sums each output in float32 (the
bias, then the taps in (ky, kx) order), rounds it once to bf16 and writes it channels-last, where the next
step reads it: ~4 ms. It rounds otherwise than oneDNN in the last bit of about one output in a million
(float32 sums in another order), and a position's result depends on nothing else in the batch.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


def one_channel_supported(conv: nn.Conv2d) -> bool:
    return (conv.in_channels == 1 and conv.groups == 1 and conv.dilation == (1, 1) and isinstance(conv.padding, tuple)
            and conv.padding_mode == "zeros" and conv.weight.dtype == torch.bfloat16)


class OneChannelConvs:
    """``module in convs`` for the model's one-input-channel convolutions the native op takes (none without
    ``ops``); ``convs(module, x)`` for a bf16 (n, 1, h, w) ``x``: (n, cout, ho, wo)-shaped, channels-last memory."""

    def __init__(self, model: nn.Module, ops: ModuleType | None) -> None:
        self.ops = ops
        self.weights: dict[nn.Conv2d, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if ops is None:
            return
        for module in model.modules():
            if isinstance(module, nn.Conv2d) and one_channel_supported(module):
                taps = module.weight.detach().float().reshape(module.out_channels, -1).t().contiguous()  # (kh*kw, cout)
                bias = None if module.bias is None else module.bias.detach().float()
                self.weights[module] = (taps, bias)

    def __contains__(self, module: nn.Module) -> bool:
        return module in self.weights

    def __call__(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        taps, bias = self.weights[module]
        (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
        out = self.ops.conv_one_channel(x, taps, bias, kh, kw, sh, sw, ph, pw)  # type: ignore[union-attr]
        return out.permute(0, 3, 1, 2)  # NCHW shape, NHWC memory, as the GEMM convolutions leave theirs
