"""Synchronous greedy generation for a list of requests, on a private engine (tests, simple scripts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.model.checkpoint import Checkpoint


@dataclass(frozen=True)
class GenRequest:
    prompt: list[int]  # full prompt ids with the audio placeholders expanded
    features: torch.Tensor  # (mel, frames)
    max_new_tokens: int
    ignore_eos: bool = False


def generate(checkpoint: Checkpoint, reqs: list[GenRequest], config: EngineConfig | None = None) -> list[list[int]]:
    """Greedy token ids for every request (EOS excluded), all batched together by one engine."""
    if not reqs:
        return []
    need = sum(len(r.prompt) + r.max_new_tokens for r in reqs)
    per_token = kv_bytes_per_token(checkpoint.config.decoder, checkpoint.dtype)
    engine = Engine(checkpoint, config or EngineConfig(kv_cache_bytes=need * per_token))
    try:
        futures = [engine.submit(RequestSpec(r.prompt, r.max_new_tokens, features=r.features,
                                             ignore_eos=r.ignore_eos)) for r in reqs]
        return [f.result().token_ids for f in futures]
    finally:
        engine.close()
