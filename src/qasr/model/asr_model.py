"""Encoder + decoder + LM head, with packed forwards."""

from __future__ import annotations

import torch
from torch import nn

from qasr.model.config import ModelConfig
from qasr.model.decoder import KVStore, Meta, TextModel
from qasr.model.encoder import AudioEncoder
from qasr.model.kernels import TORCH_KERNELS, Kernels


class Qwen3ASRModel(nn.Module):
    """Module names follow the release checkpoint after dropping its ``thinker.`` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.encoder)
        self.model = TextModel(cfg.decoder)
        # the aligner's timestamp classifier takes the LM head's place (same checkpoint key)
        self.lm_head = nn.Linear(cfg.decoder.hidden_size, cfg.head_size, bias=False)

    def init_buffers(self, device: torch.device | str) -> None:
        self.audio_tower.init_buffers(device)
        self.model.init_buffers(device)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def encode_audio(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.audio_tower(features)

    def embed(self, token_ids: torch.Tensor, audio_embeds: torch.Tensor | None,
              audio_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings, the audio placeholders' rows replaced in order by ``audio_embeds``.
        ``audio_rows``: those rows, when the caller knows them (else found here: a host/device sync)."""
        x = self.model.embed_tokens(token_ids)
        if audio_rows is not None and audio_embeds is not None:
            if audio_rows.shape[0] != audio_embeds.shape[0]:
                raise ValueError(f"{audio_rows.shape[0]} audio rows but {audio_embeds.shape[0]} audio embeddings")
            x[audio_rows] = audio_embeds.to(x.dtype)
        elif audio_embeds is not None and audio_embeds.shape[0] > 0:
            where = token_ids == self.cfg.audio_token_id
            n = int(where.sum())
            if n != audio_embeds.shape[0]:
                raise ValueError(f"{n} audio placeholders but {audio_embeds.shape[0]} audio embeddings")
            x[where] = audio_embeds.to(x.dtype)
        return x

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVStore[Meta], meta: Meta,
                logits_rows: torch.Tensor | None = None, audio_embeds: torch.Tensor | None = None,
                kernels: Kernels = TORCH_KERNELS, audio_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Packed decoder forward. Returns logits (len(logits_rows), head_size) in float32.
        ``audio_rows``: the packed rows of the audio placeholders (see ``embed``)."""
        x = self.embed(token_ids, audio_embeds, audio_rows)
        h = self.model(x, positions, cache, meta, kernels)
        if logits_rows is not None:
            h = h[logits_rows]
        return kernels.linear(self.lm_head, h).float()
