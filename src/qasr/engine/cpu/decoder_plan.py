"""The decoder's layers with every weight and kernel looked up once: ``Kernels.decoder_layers`` on the CPU.

Why: a decode step of the 0.6B decoder runs 28 layers of about a dozen small calls each, and in the module tree
each call passes through ``nn.Module.__call__``, attribute lookups on modules, ``Kernels``' dispatch and the
quantized linears' dictionaries before it reaches its kernel. Measured at one row (2 Zen 4 cores, int8 with the
int8 KV cache, products replaced by a stored result): 3.2 ms a step of work besides the products, 1.7 ms when
the same calls are made from a flat loop over prepared tuples. With the products, this plan against the module
tree alternated in one process: 19.7 -> 18.2 ms a step (bf16: 34.7 -> 32.2 ms).

The maths is ``model/decoder.py``'s ``DecoderLayer`` op for op, with the same kernels in the same order, so the
bits are the same (tests/test_decoder_plan.py compares the logits of both paths bit for bit, in bf16, float32,
int8 and int4). A plan is only built where the fused norms run (``Kernels.fused``); elsewhere the module tree
runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qasr.model.decoder import DecoderLayer, KVStore, TextModel
from qasr.model.kernels import Kernels

Product = Callable[[torch.Tensor], torch.Tensor]  # (rows, in) -> (rows, out)
Products = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # (rows, in) -> each module's (rows, out)


def bind(kernels: Kernels, module: nn.Linear) -> Product:
    """``x -> kernels.linear(module, x)`` for 2-D x, as directly as the linears object allows."""
    direct = getattr(kernels.linear, "bind", None)
    if direct is not None:
        return direct(module)
    linear = kernels.linear
    return lambda x: linear(module, x)


def bind_group(kernels: Kernels, modules: tuple[nn.Linear, ...]) -> Products:
    """``x -> kernels.linears(modules, x)`` for 2-D x, as directly as the linears object allows."""
    direct = getattr(kernels.linear, "bind_group", None)
    if direct is not None:
        return direct(modules)
    return lambda x: kernels.linears(modules, x)


class DecoderPlan:
    """``(x, cos, sin, cache, meta) -> x`` through every layer of ``text``, on ``kernels`` (which must have the
    fused norms: ``plan_for`` checks). One tuple per layer holds what the layer reads."""

    def __init__(self, text: TextModel, kernels: Kernels) -> None:
        cfg = text.cfg
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        assert kernels.rms_norm is not None and kernels.norm_rope is not None
        self.rms_norm, self.norm_rope = kernels.rms_norm, kernels.norm_rope
        self.silu_mul = kernels.silu_mul
        self.layers = [self._layer(layer, kernels) for layer in text.layers]

    @staticmethod
    def _layer(layer: DecoderLayer, kernels: Kernels) -> tuple[Any, ...]:
        attn, mlp = layer.self_attn, layer.mlp
        return (attn.layer,
                layer.input_layernorm.weight, layer.input_layernorm.eps,
                bind_group(kernels, (attn.q_proj, attn.k_proj, attn.v_proj)),
                attn.q_norm.weight, attn.q_norm.eps, attn.k_norm.weight, attn.k_norm.eps,
                bind(kernels, attn.o_proj),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                bind_group(kernels, (mlp.gate_proj, mlp.up_proj)),
                bind(kernels, mlp.down_proj))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVStore[Any],
                 meta: Any) -> torch.Tensor:
        n = x.shape[0]
        heads, kv_heads, hd = self.heads, self.kv_heads, self.head_dim
        rms_norm, norm_rope, silu_mul, attend = self.rms_norm, self.norm_rope, self.silu_mul, cache.attend
        for (index, w_in, eps_in, qkv, w_q, eps_q, w_k, eps_k, o_proj, w_post, eps_post, gate_up,
             down) in self.layers:
            q, k, v = qkv(rms_norm(x, w_in, eps_in))
            q = norm_rope(q.view(n, heads, hd), w_q, cos, sin, eps_q)
            k = norm_rope(k.view(n, kv_heads, hd), w_k, cos, sin, eps_k)
            x = x + o_proj(attend(index, q, k, v.view(n, kv_heads, hd), meta))
            gate, up = gate_up(rms_norm(x, w_post, eps_post))
            x = x + down(silu_mul(gate, up))
        return x


def plan_for(text: TextModel, kernels: Kernels) -> DecoderPlan | None:
    """A plan for ``text`` on ``kernels``, or None where the module tree must run (no fused norms for the model's
    dtype: its norms are then the unfused torch ops, which the plan does not repeat)."""
    if kernels.rms_norm is None or kernels.norm_rope is None or kernels.fused_dtype != text.embed_tokens.weight.dtype:
        return None
    return DecoderPlan(text, kernels)
