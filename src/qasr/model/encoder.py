"""The audio encoder: conv front end over chunks, windowed bidirectional transformer, projector.

Forwards are packed; attention windows start at each utterance, so its output never depends on its neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qasr.model.config import EncoderConfig, audio_token_count, post_conv_length
from qasr.model.kernels import TORCH_KERNELS, Kernels

MIN_ENCODER_ROWS = 16  # see encode


def sinusoid_table(length: int, channels: int) -> torch.Tensor:
    inc = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


@dataclass(frozen=True)
class EncoderPack:
    chunks: torch.Tensor  # (C, 1, mel, conv_chunk_frames) zero-padded chunks of all utterances
    valid_index: torch.Tensor  # (T,) rows of the (C * tokens_per_conv_chunk) conv output that are real
    window_index: torch.Tensor  # (W, Lw) packed-token index per window slot; T = pad row
    window_mask: torch.Tensor  # (W, 1, 1, Lw) True where a key is real
    token_counts: tuple[int, ...]  # output tokens per utterance
    token_slots: torch.Tensor  # (T,) the (W * Lw) window slot of each packed token
    fresh_chunks: tuple[int, ...] = ()  # per utterance: its chunks in ``chunks``
    windows: torch.Tensor | None = None  # (W, 2) int64: each window's (first packed token, length)


def plan_pack(features: list[torch.Tensor], cfg: EncoderConfig, device: torch.device | str = "cpu",
              head_chunks: Sequence[int] | None = None) -> EncoderPack:
    """The pack of ``features``; ``head_chunks[i]``: whole chunks of utterance i given as conv output."""
    cf, tpc, win = cfg.conv_chunk_frames, cfg.tokens_per_conv_chunk, cfg.window_tokens
    heads = list(head_chunks) if head_chunks is not None else [0] * len(features)
    chunks, valid, counts, fresh = [], [], [], []
    windows: list[tuple[int, int]] = []  # (start in packed tokens, length)
    chunk_base = 0
    token_base = 0
    for feat, head in zip(features, heads, strict=True):
        frames = feat.shape[-1]
        n_chunks = math.ceil(frames / cf) if head else max(1, math.ceil(frames / cf))
        if n_chunks:
            padded = F.pad(feat, (0, n_chunks * cf - frames))
            chunks.append(padded.reshape(feat.shape[0], n_chunks, cf).permute(1, 0, 2))
        fresh.append(n_chunks)
        valid.append(torch.arange(chunk_base * tpc, (chunk_base + head) * tpc))
        chunk_base += head
        total = head * tpc
        for c in range(n_chunks):
            n_valid = post_conv_length(min(cf, frames - c * cf))
            start = (chunk_base + c) * tpc
            valid.append(torch.arange(start, start + n_valid))
            total += n_valid
        for w in range(0, total, win):
            windows.append((token_base + w, min(win, total - w)))
        counts.append(total)
        chunk_base += n_chunks
        token_base += total
    # full-length windows: the same shape, so the same bits, whatever shares the pack
    lw = win
    pad_row = token_base
    index = torch.full((len(windows), lw), pad_row, dtype=torch.long)
    mask = torch.zeros((len(windows), lw), dtype=torch.bool)
    for i, (start, length) in enumerate(windows):
        index[i, :length] = torch.arange(start, start + length)
        mask[i, :length] = True
    # slots precomputed: a mask index in a layer would sync host and device
    slots = torch.cat([i * lw + torch.arange(length) for i, (_, length) in enumerate(windows)])
    mel = features[0].shape[0]
    return EncoderPack(
        chunks=(torch.cat(chunks, 0) if chunks else features[0].new_zeros(0, mel, cf)).unsqueeze(1),
        valid_index=_to(torch.cat(valid), device),
        window_index=_to(index, device),
        window_mask=_to(mask[:, None, None, :], device),
        token_counts=tuple(counts),
        token_slots=_to(slots, device),
        fresh_chunks=tuple(fresh),
        windows=_to(torch.tensor(windows, dtype=torch.long).reshape(-1, 2), device),
    )


@dataclass(frozen=True)
class EncoderRun:
    """Per utterance: the embeddings, and the conv output computed (a later call's conv head)."""

    rows: list[torch.Tensor]
    conv: list[torch.Tensor]


def _to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class EncoderAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = d_model // heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, pack: EncoderPack, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        # x: (T, d) -> (W, heads, Lw, hd) windows; one zero row serves every pad slot
        n, d = x.shape
        linear = kernels.linear
        if kernels.encoder_attention is not None and x.dtype == torch.bfloat16 and pack.windows is not None:
            q, k, v = (linear(m, x).view(n, self.heads, self.head_dim) for m in (self.q_proj, self.k_proj, self.v_proj))
            out = kernels.encoder_attention(q, k, v, pack.windows, self.head_dim ** -0.5)
            return linear(self.out_proj, out.view(n, d))
        qkv = torch.stack([linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)])  # (3, T, d)
        qkv = torch.cat([qkv, qkv.new_zeros(3, 1, d)], dim=1)
        w, lw = pack.window_index.shape
        win = qkv[:, pack.window_index.reshape(-1)].reshape(3, w, lw, self.heads, self.head_dim)
        q, k, v = win.transpose(2, 3).unbind(0)  # each (W, heads, Lw, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pack.window_mask)
        out = out.transpose(1, 2).reshape(w * lw, d)
        return linear(self.out_proj, out[pack.token_slots])


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = EncoderAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, pack: EncoderPack, kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        linear = kernels.linear
        x = x + self.self_attn(self.self_attn_layer_norm(x), pack, kernels)
        x = x + linear(self.fc2, F.gelu(linear(self.fc1, self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # keep fp16 activations finite, as the reference does
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    """Mel features -> LM-sized embeddings."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        freq = post_conv_length(cfg.num_mel_bins)
        self.conv_out = nn.Linear(ch * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.positions: torch.Tensor | None = None  # not in checkpoints

    def init_buffers(self, device: torch.device | str) -> None:
        self.positions = sinusoid_table(self.cfg.tokens_per_conv_chunk, self.cfg.d_model).to(device)

    def conv_front(self, chunks: torch.Tensor, conv_batch: int | None = None,
                   kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        """(C, 1, mel, frames) -> (C, tokens_per_conv_chunk, d_model), ``conv_batch`` chunks at a time."""
        group = conv_batch or self.cfg.conv_chunksize
        outs = []
        for start in range(0, chunks.shape[0], group):
            x = chunks[start:start + group]
            single = x.shape[0] == 1
            if single:  # a lone chunk gets other low bits than in a batch: pad to two
                x = torch.cat([x, torch.zeros_like(x)])
            x = kernels.conv_of_gelu(self.conv2d2, kernels.conv(self.conv2d1, x))
            x = F.gelu(kernels.conv_of_gelu(self.conv2d3, x))
            c, ch, freq, t = x.shape
            # 2-D: a 3-D non-contiguous input makes linear expand the weight per chunk
            x = kernels.linear(self.conv_out, x.permute(0, 3, 1, 2).reshape(c * t, ch * freq))
            outs.append(x.view(c, t, -1)[:1] if single else x.view(c, t, -1))
        x = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
        assert self.positions is not None, "call init_buffers() after loading weights"
        return x + self.positions[: x.shape[1]].to(x.dtype)

    def forward(self, features: list[torch.Tensor], conv_batch: int | None = None,
                kernels: Kernels = TORCH_KERNELS) -> list[torch.Tensor]:
        """Per-utterance (mel, frames) features -> per-utterance (tokens, output_dim) embeddings."""
        return self.encode(features, conv_batch=conv_batch, kernels=kernels).rows

    def encode(self, features: list[torch.Tensor], conv_heads: Sequence[torch.Tensor | None] | None = None,
               conv_batch: int | None = None, kernels: Kernels = TORCH_KERNELS) -> EncoderRun:
        """``forward``; ``conv_heads[i]`` (an earlier run's ``conv``) stands for utterance i's first whole chunks,
        ``features[i]`` for the frames after."""
        p = self.parameters().__next__()
        feats = [f.to(p.device, p.dtype) for f in features]
        heads = list(conv_heads) if conv_heads is not None else [None] * len(feats)
        n_real = len(feats)
        cf, tpc = self.cfg.conv_chunk_frames, self.cfg.tokens_per_conv_chunk
        rows = sum(audio_token_count(f.shape[-1], cf) + (h.shape[0] * tpc if h is not None else 0)
                   for f, h in zip(feats, heads, strict=True))
        if rows < MIN_ENCODER_ROWS:
            # a zero utterance pads the call: BLAS picks other kernels (other low bits) for a few rows
            feats.append(feats[0].new_zeros(feats[0].shape[0], -(-(MIN_ENCODER_ROWS - rows) // tpc) * cf))
            heads.append(None)
        pack = plan_pack(feats, self.cfg, p.device, [h.shape[0] if h is not None else 0 for h in heads])
        fresh = self.conv_front(pack.chunks, conv_batch, kernels) if pack.chunks.shape[0] else None
        parts, computed, at = [], [], 0
        for head, n in zip(heads, pack.fresh_chunks, strict=True):
            if head is not None:
                parts.append(head.to(p.dtype))
            own = fresh[at:at + n] if fresh is not None else pack.chunks.new_zeros(0, tpc, self.cfg.d_model)
            parts.append(own)
            computed.append(own)
            at += n
        x = torch.cat(parts) if any(h is not None for h in heads) else fresh
        assert x is not None
        x = x.reshape(-1, x.shape[-1])[pack.valid_index]
        for layer in self.layers:
            x = layer(x, pack, kernels)
        x = kernels.linear(self.proj2, F.gelu(kernels.linear(self.proj1, self.ln_post(x))))
        return EncoderRun(list(torch.split(x, list(pack.token_counts)))[:n_real], computed[:n_real])
