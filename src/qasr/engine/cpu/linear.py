"""CPU speed-up for bf16 inference: replace nn.Linear weights by prepacked ones.

First choice is qasr's own AVX512-BF16 kernel (engine/cpu/csrc/bf16_linear.cpp): a row's result never
depends on the other rows of the call, so a request decodes to the same tokens whatever shares its
batch, and it streams the weights of a decode step faster than oneDNN. Without it (no compiler, no
AVX512-BF16) the weights are reordered for oneDNN, which runs small-batch products two to three times
faster than torch's plain bf16 GEMM but may round a row differently depending on the batch size.
Both compute the same bf16 product with float accumulation.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from qasr.engine.cpu.native import linear_kernel

log = logging.getLogger(__name__)


class InvariantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: ModuleType) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernel = kernel
        self.packed = kernel.pack(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.kernel.linear(x.reshape(-1, shape[-1]), self.packed, self.out_features, self.bias)
        return out.view(*shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Swap every nn.Linear in ``model`` for a PackedLinear (in place). Returns how many were packed.

    Tied weights stay correct: each packed copy is made from the tensor the module holds.
    """
    kernel = linear_kernel()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                try:
                    packed = (InvariantLinear(child, kernel) if kernel is not None and child.in_features % 2 == 0
                              else PackedLinear(child, batch_hint))
                    setattr(parent, name, packed)
                    count += 1
                except RuntimeError as exc:  # an unusual build without the op: keep the plain module
                    log.warning("qasr: could not prepack %s (%s)", name, exc)
                    return count
    return count


def channels_last_convs(model: nn.Module) -> int:
    """Store conv weights channels-last: oneDNN then runs the encoder's 480-channel convolutions about
    20% faster on CPUs (activations follow the weight's layout). Same maths."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
            count += 1
    return count


def fuse_norms(model: nn.Module) -> int:
    """Point every decoder RMSNorm at the fused bf16 kernels (RMSNorm; q/k-norm + rotary), where they
    build. Returns how many norms use them."""
    from qasr.engine.cpu.native import decoder_ops_kernel
    from qasr.model.decoder import RMSNorm

    ops = decoder_ops_kernel()
    if ops is None:
        return 0
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.fused = ops
    return len(norms)
