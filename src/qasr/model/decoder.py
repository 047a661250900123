"""The Qwen3 text decoder: RMSNorm, q/k-norm, GQA, rotary positions, SwiGLU.

A forward takes a packed batch (sequences' new tokens concatenated, each with its positions) and a KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from qasr.model.config import DecoderConfig
from qasr.model.kernels import TORCH_KERNELS, Kernels

Meta = TypeVar("Meta")  # a cache's per-forward metadata
_MetaIn = TypeVar("_MetaIn", contravariant=True)


class KVStore(Protocol[_MetaIn]):
    """Stores this layer's new k/v, attends, returns (N, heads*hd); ``meta`` passes through the decoder unread."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: _MetaIn) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        if kernels.fused(x):
            return kernels.rms_norm(x, self.weight, self.eps)  # type: ignore[misc]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVStore[Meta],
                meta: Meta, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = kernels.linears((self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if kernels.fused(q):
            q = kernels.norm_rope(q, self.q_norm.weight, cos, sin, self.q_norm.eps)  # type: ignore[misc]
            k = kernels.norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps)  # type: ignore[misc]
        else:
            q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = cache.attend(self.layer, q, k, v, meta)  # (N, heads * hd)
        return kernels.linear(self.o_proj, out)


class DecoderLayer(nn.Module):
    """One decoder layer; ``BoundDecoderLayers`` mirrors it op for op, bit for bit (change both)."""

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVStore[Meta],
                meta: Meta, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, kernels), cos, sin, cache, meta, kernels)
        return x + self.mlp(self.post_attention_layernorm(x, kernels), kernels)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        gate, up = kernels.linears((self.gate_proj, self.up_proj), x)
        return kernels.linear(self.down_proj, kernels.silu_mul(gate, up))


Product = Callable[[torch.Tensor], torch.Tensor]  # (rows, in) -> (rows, out)
Products = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # (rows, in) -> each module's (rows, out)


def bind_linear(kernels: Kernels, module: nn.Linear) -> Product:
    """``x -> kernels.linear(module, x)`` for 2-D x."""
    direct = getattr(kernels.linear, "bind", None)
    if direct is not None:
        return direct(module)
    linear = kernels.linear
    return lambda x: linear(module, x)


def bind_linears(kernels: Kernels, modules: tuple[nn.Linear, ...]) -> Products:
    """``x -> kernels.linears(modules, x)`` for 2-D x."""
    direct = getattr(kernels.linear, "bind_group", None)
    if direct is not None:
        return direct(modules)
    return lambda x: kernels.linears(modules, x)


class BoundDecoderLayers:
    """``(x, cos, sin, cache, meta) -> x`` through every layer of ``text``; ``kernels`` must have the fused norms."""

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
                bind_linears(kernels, (attn.q_proj, attn.k_proj, attn.v_proj)),
                attn.q_norm.weight, attn.q_norm.eps, attn.k_norm.weight, attn.k_norm.eps,
                bind_linear(kernels, attn.o_proj),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                bind_linears(kernels, (mlp.gate_proj, mlp.up_proj)),
                bind_linear(kernels, mlp.down_proj))

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


def bind_decoder_layers(text: TextModel, kernels: Kernels) -> BoundDecoderLayers | None:
    """``text``'s layers bound to ``kernels``, or None where the fused norms do not apply."""
    if kernels.rms_norm is None or kernels.norm_rope is None or kernels.fused_dtype != text.embed_tokens.weight.dtype:
        return None
    return BoundDecoderLayers(text, kernels)


class TextModel(nn.Module):
    """Embeddings + layers + final norm (weights under ``model.*`` after key mapping)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.inv_freq: torch.Tensor | None = None

    def init_buffers(self, device: torch.device | str) -> None:
        hd = self.cfg.head_dim
        exponent = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
        self.inv_freq = (1.0 / (self.cfg.rope_theta ** exponent)).to(device)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape (N, 1, head_dim) for the given absolute positions."""
        assert self.inv_freq is not None, "call init_buffers() after loading weights"
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVStore[Meta],
                meta: Meta, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)
        if kernels.decoder_layers is not None:
            x = kernels.decoder_layers(x, cos, sin, cache, meta)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, cache, meta, kernels)
        return self.norm(x, kernels)
