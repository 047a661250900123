"""The encoder's convolutions on the CPU, with weights prepared once and kept here (the model's own
modules are never changed).

The 480-channel 3x3 stride-2 convolutions run as bf16 GEMMs on qasr's row-invariant kernel: oneDNN
runs them at ~260 GFLOP/s on two AVX512-BF16 cores; the same products as a (positions x 9*480) by
(9*480 x 480) GEMM reach ~400 GFLOP/s and, like every qasr bf16 linear, give a position the same
result whatever else is in the batch. The kernel reads each position's 3 x (3 * 480) inputs straight
from the padded channels-last activation (implicit im2col: materialising the columns cost more than
the time saved). Outputs stay channels-last (NCHW-shaped views of NHWC memory), so the next
convolution reads them without a layout copy. The first convolution (one input channel) runs on the
native encoder ops when they built (one_channel_conv.py), writing channels-last too, and the GELU between
two convolutions is done while padding the next one's input (padded_input.py). Other convolutions (all of
them without the kernels) run on oneDNN with channels-last weight copies, about 20% faster than contiguous
ones on CPUs (activations follow the weight's layout). Same maths.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.other_convs import OtherConvs
from qasr.engine.cpu.padded_input import padded_nhwc


class CpuConvs:
    """``conv(module, x)`` for every nn.Conv2d of a model; ``of_gelu(module, x)`` is ``conv(module, F.gelu(x))``,
    with the GELU done while padding the GEMM's input when ``ops`` (the native encoder ops) is given."""

    def __init__(self, model: nn.Module, kernel: ModuleType | None, ops: ModuleType | None = None) -> None:
        self.kernel = kernel
        self.ops = ops
        self.gemm: dict[nn.Conv2d, tuple[torch.Tensor, torch.Tensor | None]] = {}
        others: list[nn.Conv2d] = []
        for module in model.modules():
            if not isinstance(module, nn.Conv2d):
                continue
            if kernel is not None and gemm_supported(module):
                w = module.weight.detach().permute(0, 2, 3, 1).reshape(module.out_channels, -1)  # (cout, kh*kw*cin)
                bias = None if module.bias is None else module.bias.detach().float()
                self.gemm[module] = (kernel.pack(w.contiguous()), bias)
            else:
                others.append(module)
        self.others = OtherConvs(model, others, ops)  # the first convolution, and all without the kernel

    def __call__(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(module, x) if module in self.gemm else self.others(module, x)

    def of_gelu(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(module, x, gelu=True) if module in self.gemm else self(module, F.gelu(x))

    def _gemm(self, module: nn.Conv2d, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        packed, bias = self.gemm[module]
        n, _, h, w = x.shape
        (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
        xh = padded_nhwc(x, ph, pw, gelu, self.ops)  # (n, h+2ph, w+2pw, cin)
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        out = self.kernel.conv(xh, packed, module.out_channels, bias, kh, kw, sh, sw)  # type: ignore[union-attr]
        return out.view(n, ho, wo, module.out_channels).permute(0, 3, 1, 2)  # NCHW shape, NHWC memory


def gemm_supported(conv: nn.Conv2d) -> bool:
    # the kernel takes input features in pairs along each kernel row: kernel width x channels must be even
    return (conv.groups == 1 and conv.dilation == (1, 1) and isinstance(conv.padding, tuple)
            and conv.padding_mode == "zeros" and conv.kernel_size[1] * conv.in_channels % 2 == 0)
