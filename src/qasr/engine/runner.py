"""Executes one engine step on the device: packed encoder call, then one packed decoder forward
(decode rows first, prefill chunks after) and a greedy argmax with a single host sync."""

from __future__ import annotations

import time

import numpy as np
import torch

from qasr.engine.kv_cache import KVPool
from qasr.engine.request import Request
from qasr.engine.scheduler import StepPlan
from qasr.features import LogMel
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.decoder import AttentionMeta


class Runner:
    def __init__(self, model: Qwen3ASRModel, pool: KVPool, features: LogMel, conv_batch: int = 64) -> None:
        self.model = model
        self.pool = pool
        self.features = features
        self.conv_batch = conv_batch
        self.audio_token_id = model.cfg.audio_token_id

    @torch.inference_mode()
    def encode(self, reqs: list[Request]) -> float:
        """Packed encoder over all given requests; features are made here and dropped right after.
        Returns the seconds spent on features."""
        feats = []
        t0 = time.perf_counter()
        for req in reqs:
            if req.features is None:
                assert req.waveform is not None
                req.features = self.features(req.waveform)
            feats.append(req.features)
        feat_s = time.perf_counter() - t0
        outs = self.model.audio_tower(feats, conv_batch=self.conv_batch)
        for req, out in zip(reqs, outs, strict=True):
            if out.shape[0] != req.audio_tokens:
                raise ValueError(f"prompt has {req.audio_tokens} audio placeholders, encoder gave {out.shape[0]}")
            req.audio = out
            req.audio_before = np.concatenate(
                [[0], np.cumsum(np.asarray(req.prompt) == self.audio_token_id)])
            req.features = None
            req.waveform = None
        return feat_s

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> list[tuple[Request, int]]:
        """Run decode rows and prefill chunks together; return (request, next token) for every request
        whose logits were computed (all decode rows, and prefill chunks that complete their prompt)."""
        dev = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        starts, qlens, ctxs = [], [], []
        audio: list[torch.Tensor] = []
        sampled: list[Request] = []
        rows: list[int] = []
        for req in plan.decode:
            ctx = len(req.prompt) + len(req.output) - 1
            ids.append(req.output[-1])
            positions.append(ctx)
            starts.append(req.start)
            qlens.append(1)
            ctxs.append(ctx)
            rows.append(len(ids) - 1)
            sampled.append(req)
        reached: dict[int, int] = {}  # a request's later chunks in this step start where its earlier ones end
        for req, n in plan.prefill:
            a = reached.get(id(req), req.prefilled)
            b = reached[id(req)] = a + n
            ids.extend(req.prompt[a:b])
            positions.extend(range(a, b))
            starts.append(req.start)
            qlens.append(n)
            ctxs.append(a)
            lo, hi = int(req.audio_before[a]), int(req.audio_before[b])
            if hi > lo:
                audio.append(req.audio[lo:hi])
            if b == len(req.prompt):
                rows.append(len(ids) - 1)
                sampled.append(req)
        meta = AttentionMeta.build(starts, qlens, ctxs, dev, num_decode=len(plan.decode))
        logits = self.model(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.pool, meta,
            logits_rows=torch.tensor(rows, device=dev) if rows else torch.zeros(0, dtype=torch.long, device=dev),
            audio_embeds=torch.cat(audio) if audio else None,
        )
        for req, n in plan.prefill:
            req.prefilled += n
            if req.prefill_done:
                req.audio = None  # encoder output no longer needed
        tokens = logits.argmax(-1).tolist() if rows else []
        return list(zip(sampled, tokens, strict=True))
