"""Greedy generation for a fixed group of requests: packed encoder, packed prefill, batched decode.

This is the simple synchronous path; the continuous-batching engine reuses the same forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qasr.engine.kv_cache import SlotKVCache
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.decoder import AttentionMeta


@dataclass
class GenRequest:
    prompt: list[int]  # full prompt ids with the audio placeholders expanded
    features: torch.Tensor  # (mel, frames)
    max_new_tokens: int
    ignore_eos: bool = False
    output: list[int] = field(default_factory=list)


def prefill_batch(model: Qwen3ASRModel, reqs: list[GenRequest], slots: list[int], cache: SlotKVCache,
                  audio: list[torch.Tensor]) -> torch.Tensor:
    """One packed forward over whole prompts; returns the next-token logits (len(reqs), vocab)."""
    dev = model.device
    ids = torch.tensor([t for r in reqs for t in r.prompt], device=dev)
    positions = torch.cat([torch.arange(len(r.prompt), device=dev) for r in reqs])
    lens = [len(r.prompt) for r in reqs]
    last = torch.tensor(lens, device=dev).cumsum(0) - 1
    meta = AttentionMeta(tuple(slots), tuple(lens), (0,) * len(reqs))
    return model(ids, positions, cache, meta, logits_rows=last, audio_embeds=torch.cat(audio))


@torch.inference_mode()
def generate(model: Qwen3ASRModel, reqs: list[GenRequest], eos_ids: tuple[int, ...],
             prefill_tokens: int = 8192) -> list[list[int]]:
    """Greedy decode every request; outputs exclude the EOS token."""
    if not reqs:
        return []
    capacity = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    cache = SlotKVCache(model.cfg.decoder, len(reqs), capacity, model.device, model.dtype)
    eos = torch.tensor(sorted(eos_ids), device=model.device)
    audio = model.encode_audio([r.features for r in reqs])
    next_tokens: list[int] = [0] * len(reqs)
    # Prefill in groups under a token budget (bounds activation memory for long prompts).
    group: list[int] = []
    for i in range(len(reqs) + 1):
        if i < len(reqs) and (not group or sum(len(reqs[j].prompt) for j in group) + len(reqs[i].prompt)
                              <= prefill_tokens):
            group.append(i)
            continue
        logits = prefill_batch(model, [reqs[j] for j in group], group, cache, [audio[j] for j in group])
        for j, tok in zip(group, logits.argmax(-1).tolist(), strict=True):
            next_tokens[j] = tok
        group = [i]
    active = []
    for i, r in enumerate(reqs):
        if _accept(r, next_tokens[i], eos):
            active.append(i)
    while active:
        dev = model.device
        ids = torch.tensor([next_tokens[i] for i in active], device=dev)
        ctx = [len(reqs[i].prompt) + len(reqs[i].output) - 1 for i in active]
        positions = torch.tensor(ctx, device=dev)
        meta = AttentionMeta(tuple(active), (1,) * len(active), tuple(ctx))
        logits = model(ids, positions, cache, meta)
        toks = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(active, toks, strict=True):
            next_tokens[i] = tok
            if _accept(reqs[i], tok, eos):
                still.append(i)
        active = still
    return [r.output for r in reqs]


def _accept(req: GenRequest, token: int, eos: torch.Tensor) -> bool:
    """Record ``token``; return whether the request continues."""
    if not req.ignore_eos and bool((eos == token).any()):
        return False
    req.output.append(token)
    return len(req.output) < req.max_new_tokens
