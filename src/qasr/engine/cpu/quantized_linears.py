"""The quantized modes' ``linear``: a product per nn.Linear; linears of one input (q/k/v, gate/up) as one
product split by columns, which changes no bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from qasr.engine.cpu.int4 import Int4Weight
from qasr.engine.cpu.int8 import Int8Weight
from qasr.model.weights import release_file_pages, return_free_heap


@dataclass(frozen=True)
class Product:

    weight: Int8Weight | Int4Weight
    kernel: ModuleType | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.product(x, self.kernel)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.weight.bound(self.kernel)


RETURN_HEAP_BYTES = 64 << 20  # quantized weight bytes between two hand-backs of the C heap's free pages
# (weight, bias, the module or a group's first) -> product
MakeProduct = Callable[[torch.Tensor, "torch.Tensor | None", nn.Linear], Product]


def same_input_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """Each attention's (q, k, v) and each MLP's (gate, up)."""
    from qasr.model.decoder import DecoderAttention, SwiGLU

    groups: list[tuple[nn.Linear, ...]] = []
    for module in model.modules():
        if isinstance(module, DecoderAttention):
            groups.append((module.q_proj, module.k_proj, module.v_proj))
        elif isinstance(module, SwiGLU):
            groups.append((module.gate_proj, module.up_proj))
    return groups


class QuantizedLinears:
    """``linear(module, x)`` for every nn.Linear of a model, ``group(modules, x)`` for the given groups."""

    def __init__(self, model: nn.Module, make: MakeProduct, kind: str,
                 groups: Sequence[tuple[nn.Linear, ...]] = ()) -> None:
        self.kind = kind
        self.groups: dict[tuple[nn.Linear, ...], tuple[Product, tuple[int, ...]]] = {}
        self._member: dict[nn.Linear, tuple[tuple[nn.Linear, ...], int]] = {}
        for group in groups:
            biases = [m.bias for m in group]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                continue  # a zero bias would turn -0.0 into +0.0 where the module adds nothing
            self._member.update({m: (group, i) for i, m in enumerate(group)})
        self.products: dict[nn.Linear, Product] = {}
        items = [(group, True) for group in dict.fromkeys(g for g, _ in self._member.values())]
        items += [((m,), False) for m in model.modules() if isinstance(m, nn.Linear) and m not in self._member]
        # the largest first: its quantization's scratch is then the peak, not added on top of the others' copies
        unreturned = 0  # weight bytes quantized since the heap's free pages were last handed back
        for modules, grouped in sorted(items, key=lambda item: -sum(m.weight.numel() for m in item[0])):
            weight = torch.cat([m.weight.detach() for m in modules]) if grouped else modules[0].weight.detach()
            biases = [m.bias for m in modules]
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # type: ignore[union-attr]
            if grouped:
                self.groups[modules] = (make(weight, bias, modules[0]), tuple(m.out_features for m in modules))
            else:
                self.products[modules[0]] = make(weight, bias, modules[0])
            for m in modules:
                release_file_pages(m.weight)  # the product's copy is the one read from now on
            unreturned += sum(m.weight.nbytes for m in modules)
            if unreturned >= RETURN_HEAP_BYTES:  # the scratch freed between the products made so far
                return_free_heap()
                unreturned = 0

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        product = self.products.get(module)
        if product is None:
            if module in self._member:
                group, i = self._member[module]
                return self.group(group, x)[i]
            raise KeyError(f"{module!r} is not a linear layer of the model these {self.kind} weights were made from")
        shape = x.shape
        return product(x.reshape(-1, shape[-1])).view(*shape[:-1], product.weight.n)

    def bind(self, module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self(module, x)`` for 2-D x."""
        product = self.products.get(module)
        if product is None:
            return lambda x: self(module, x)
        return product.bound()

    def bind_group(self, modules: tuple[nn.Linear, ...]) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """``x -> self.group(modules, x)`` for 2-D x."""
        entry = self.groups.get(modules)
        if entry is None:
            return lambda x: self.group(modules, x)
        product, sizes = entry[0].bound(), list(entry[1])
        # not Tensor.split's Python wrapper (docs/log/*-cpu-group-split.md)
        return lambda x: product(x).split_with_sizes(sizes, -1)

    def group(self, modules: tuple[nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's product of ``x`` (column views for a prepared group)."""
        entry = self.groups.get(modules)
        if entry is None:
            return tuple(self(m, x) for m in modules)
        product, sizes = entry
        shape = x.shape
        out = product(x.reshape(-1, shape[-1])).view(*shape[:-1], sum(sizes))
        return out.split(sizes, dim=-1)


def int8_linears(model: nn.Module, kernel: ModuleType | None = None,
                 groups: Sequence[tuple[nn.Linear, ...]] = ()) -> QuantizedLinears:
    """``quantize="int8"``: every linear W8A8 on ``kernel`` (None: the torch reference)."""
    return QuantizedLinears(model, lambda w, b, _: Product(Int8Weight.of(w, b, kernel), kernel), "int8", groups)


def int4_decoder_linears(model: nn.Module, int8_kernel: ModuleType | None = None,
                         int4_kernel: ModuleType | None = None,
                         groups: Sequence[tuple[nn.Linear, ...]] = ()) -> QuantizedLinears:
    """``quantize="int4"``: the decoder's linears and LM head W4A8, the encoder's W8A8."""
    decoder = {m for m in model.model.modules() if isinstance(m, nn.Linear)} | {model.lm_head}

    def make(weight: torch.Tensor, bias: torch.Tensor | None, module: nn.Linear) -> Product:
        if module in decoder:
            return Product(Int4Weight.of(weight, bias, int4_kernel), int4_kernel)
        return Product(Int8Weight.of(weight, bias, int8_kernel), int8_kernel)

    return QuantizedLinears(model, make, "int4", groups)
