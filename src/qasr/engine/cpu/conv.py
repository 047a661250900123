"""The encoder's convolutions on the CPU, weights prepared once and kept here: the 480-channel ones as bf16 GEMMs
on the row-invariant kernel (patches read in place, outputs channels-last), the others on the native first
convolution or oneDNN (docs/log/*-cpu-encoder-conv-gemm.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qasr.engine.cpu.activation_tables import gelu_table
from qasr.model.weights import release_file_pages


class CpuConvs:
    """``conv(module, x)`` for every nn.Conv2d of a model; ``of_gelu(module, x)``: ``conv(module, F.gelu(x))``."""

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
                release_file_pages(module.weight)  # the packed copy is the one read from now on
            else:
                others.append(module)
        self.others = OtherConvs(model, others, ops)

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
    # input features come in pairs along each kernel row
    return (conv.groups == 1 and conv.dilation == (1, 1) and isinstance(conv.padding, tuple)
            and conv.padding_mode == "zeros" and conv.kernel_size[1] * conv.in_channels % 2 == 0)


# GELU is always torch's contiguous-tensor F.gelu (its strided loops differ in the last bit for some values).

def padded_nhwc(x: torch.Tensor, ph: int, pw: int, gelu: bool = False, ops: ModuleType | None = None) -> torch.Tensor:
    """(n, c, h, w)-shaped ``x`` (any layout) -> (n, h + 2 ph, w + 2 pw, c) contiguous: zeros around ``x``, or
    around its GELU with ``gelu``; one native pass for bf16 when ``ops`` is given, else torch ops (the same bits)."""
    nhwc = x.permute(0, 2, 3, 1)
    if gelu and ops is not None and x.dtype == torch.bfloat16:
        return ops.pad_gelu(nhwc, gelu_table(), ph, pw)
    if gelu:
        nhwc = F.gelu(nhwc.contiguous())
    return F.pad(nhwc, (0, 0, pw, pw, ph, ph)).contiguous()


# The first convolution (one input channel) natively: float32 sums rounded once, written channels-last.

def one_channel_supported(conv: nn.Conv2d) -> bool:
    return (conv.in_channels == 1 and conv.groups == 1 and conv.dilation == (1, 1) and isinstance(conv.padding, tuple)
            and conv.padding_mode == "zeros" and conv.weight.dtype == torch.bfloat16)


class OneChannelConvs:
    """``convs(module, x)`` for the one-input-channel convolutions the native op takes (``module in convs``)."""

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
        return out.permute(0, 3, 1, 2)  # NCHW shape, NHWC memory



class OtherConvs:
    """``convs(module, x)`` for the convolutions a GEMM path leaves: the native first one where it applies, else
    oneDNN with a channels-last weight copy."""

    def __init__(self, model: nn.Module, modules: Iterable[nn.Conv2d], ops: ModuleType | None) -> None:
        self.one_channel = OneChannelConvs(model, ops)
        self.channels_last = {m: m.weight.detach().contiguous(memory_format=torch.channels_last) for m in modules}

    def __call__(self, module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        if module in self.one_channel and x.dtype == torch.bfloat16:
            return self.one_channel(module, x)
        weight = self.channels_last.get(module, module.weight)
        return F.conv2d(x, weight, module.bias, module.stride, module.padding, module.dilation, module.groups)
