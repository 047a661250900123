"""The encoder's 480-channel convolutions as bf16 GEMMs on qasr's row-invariant kernel.

oneDNN runs the 3x3 stride-2 480-channel convolutions at ~260 GFLOP/s on two AVX512-BF16 cores; the
same products as a (positions x 9*480) by (9*480 x 480) GEMM reach ~400 GFLOP/s, and, like every qasr
bf16 linear, give a position the same result whatever else is in the batch. The kernel reads each
position's 3 x (3 * 480) inputs straight from the padded channels-last activation (implicit im2col:
materialising the columns cost more than the time saved). Outputs stay channels-last (NCHW-shaped
views of NHWC memory), so the next convolution reads them without a layout copy. The first convolution
(one input channel, memory-bound) stays on oneDNN.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class GemmConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d, kernel: ModuleType) -> None:
        super().__init__()
        assert supported(conv)
        self.kernel = kernel
        self.out_channels = conv.out_channels
        self.kh, self.kw = conv.kernel_size
        self.stride = conv.stride
        self.padding = conv.padding
        w = conv.weight.detach().permute(0, 2, 3, 1).reshape(conv.out_channels, -1)  # (cout, kh*kw*cin)
        self.packed = kernel.pack(w.contiguous())
        self.bias = None if conv.bias is None else conv.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        (sh, sw), (ph, pw) = self.stride, self.padding
        xh = F.pad(x.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph)).contiguous()  # (n, h+2ph, w+2pw, cin)
        ho, wo = (h + 2 * ph - self.kh) // sh + 1, (w + 2 * pw - self.kw) // sw + 1
        out = self.kernel.conv(xh, self.packed, self.out_channels, self.bias, self.kh, self.kw, sh, sw)
        return out.view(n, ho, wo, self.out_channels).permute(0, 3, 1, 2)  # NCHW shape, NHWC memory


def supported(conv: nn.Conv2d) -> bool:
    # the kernel takes input features in pairs along each kernel row: kernel width x channels must be even
    return (conv.groups == 1 and conv.dilation == (1, 1) and isinstance(conv.padding, tuple)
            and conv.padding_mode == "zeros" and conv.kernel_size[1] * conv.in_channels % 2 == 0)


def gemm_convs(model: nn.Module, kernel: ModuleType) -> int:
    """Swap every supported nn.Conv2d in ``model`` for a GemmConv2d (in place). Returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d) and supported(child):
                setattr(parent, name, GemmConv2d(child, kernel))
                count += 1
    return count
