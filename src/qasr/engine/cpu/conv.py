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

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.activation_tables import gelu_table


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


# (padded_input.py) The input of the encoder's 3x3 convolutions as their GEMM kernels read it: channels-last,
# zero-padded, and, between two convolutions, GELU of the previous one's output.
#
# With the native encoder ops that is one pass over a bf16 activation (``pad_gelu``) instead of torch's three (gelu;
# F.pad filling a new tensor with zeros, then copying the interior). Its GELU is a lookup in ``gelu_table()``:
# torch's own F.gelu evaluated once at each of the 65,536 bf16 values.
#
# Which GELU: torch's bf16 F.gelu is not one function of the value. On a contiguous tensor it runs its vectorized
# loop, whose bits do not depend on where a value sits (a partial last vector included: checked for all 65,536
# values in tests/engine/cpu/test_encoder_ops.py); on a channels-last or strided tensor it takes other loops, which
# differ from that in the last bit for ~3% of the values (measured: 53,598 of 1,584,000 at 480 channels). Here GELU
# is always the contiguous one: the table, and the torch fallback below, which applies F.gelu to the contiguous
# channels-last copy (the padding's copy was made anyway). The plain model (TORCH_KERNELS) applies F.gelu to torch's
# contiguous NCHW convolution output: the same bits.

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


# (one_channel_conv.py) The encoder's first convolution (one input channel: the log-mel image) on the native encoder
# ops.
#
# oneDNN ran it at 4-20 ms per 8 one-second chunks on two Zen 4 cores, its speed moving between processes with the
# strides of the weight and the input, and wrote its output channels-first, which the next convolution's padding
# then transposed (25 MB per 8 chunks). ``conv_one_channel`` (encoder_ops.cpp) sums each output in float32 (the
# bias, then the taps in (ky, kx) order), rounds it once to bf16 and writes it channels-last, where the next step
# reads it: ~4 ms. It rounds otherwise than oneDNN in the last bit of about one output in a million (float32 sums in
# another order), and a position's result depends on nothing else in the batch.

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


# (other_convs.py) The convolutions that neither GEMM path (conv.py's bf16, int8.py's int8) takes: the encoder's
# first one (one input channel) on the native encoder ops for bf16 when they built (one_channel_conv.py), and every
# other one (that one included, without the ops) on oneDNN with a channels-last weight copy, about 20% faster than a
# contiguous one on CPUs (the activations follow the weight's layout). Both GEMM paths hand these the same way, so
# it is here once.

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
