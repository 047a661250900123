"""Executes one engine step on the device: packed encoder call, then one packed decoder forward
(decode rows first, prefill chunks after) and a greedy argmax with a single host sync."""

from __future__ import annotations

import time

import numpy as np
import torch

from qasr.engine.device import PreparedModel
from qasr.engine.kv_cache import KVPool
from qasr.engine.request import Request
from qasr.engine.scheduler import StepPlan
from qasr.features import LogMel
from qasr.model.decoder import AttentionMeta


class Runner:
    def __init__(self, prepared: PreparedModel, pool: KVPool, features: LogMel, conv_batch: int = 64) -> None:
        self.model = prepared.model
        self.kernels = prepared.kernels
        self.pool = pool
        self.features = features
        self.conv_batch = conv_batch

    @torch.inference_mode()
    def encode(self, slices: list[tuple[Request, int]]) -> float:
        """One packed encoder call over a slice of each request's audio: ``n`` tokens from its
        ``encoded_tokens`` on, which lies on the 8 s window grid (windows attend only within
        themselves, so a slice's output equals those rows of the whole). Features are made at a
        request's first slice (the log-mel needs the whole utterance) and dropped after its last.
        Nothing is changed unless the whole call succeeds. Returns the seconds spent on features."""
        enc = self.model.cfg.encoder
        window_frames = enc.window_tokens // enc.tokens_per_chunk * enc.chunk_frames
        feats = []
        t0 = time.perf_counter()
        for req, n in slices:
            if req.features is None:
                assert req.waveform is not None
                req.features = self.features(req.waveform)
                req.waveform = None
            f0 = req.encoded_tokens // enc.window_tokens * window_frames
            f1 = f0 + -(-n // enc.window_tokens) * window_frames
            feats.append(req.features[:, f0:f1])
        feat_s = time.perf_counter() - t0
        outs = self.model.audio_tower(feats, conv_batch=self.conv_batch, kernels=self.kernels)
        for (req, n), out in zip(slices, outs, strict=True):
            if out.shape[0] != n:
                raise ValueError(f"request {req.id}: encoder gave {out.shape[0]} tokens for a slice of {n}")
        for (req, n), out in zip(slices, outs, strict=True):
            if req.audio is None:
                req.audio = out.new_empty((req.audio_tokens, out.shape[1]))
            req.audio[req.encoded_tokens:req.encoded_tokens + n] = out
            req.encoded_tokens += n
            if req.encoded:
                req.features = None
        return feat_s

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> list[tuple[Request, int]]:
        """Run decode rows and prefill chunks together; return (request, next token) for every request
        whose logits were computed (all decode rows, and prefill chunks that complete their prompt).
        Alignment requests get the head's argmax at their classifier positions in ``req.classes``."""
        dev = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        starts, qlens, ctxs = [], [], []
        audio: list[torch.Tensor] = []
        sampled: list[Request] = []
        rows: list[int] = []
        sampled_at: list[int] = []  # index in ``rows`` of each sampled request's row
        classified: list[tuple[Request, int, int]] = []  # (alignment request, first index in ``rows``, count)
        for req in plan.decode:
            ctx = len(req.prompt) + len(req.output) - 1
            ids.append(req.output[-1])
            positions.append(ctx)
            starts.append(req.start)
            qlens.append(1)
            ctxs.append(ctx)
            sampled_at.append(len(rows))
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
            if req.classify is not None:  # alignment: the head runs only at its positions in [a, b)
                c0, c1 = np.searchsorted(req.classify, [a, b])
                classified.append((req, len(rows), int(c1 - c0)))
                rows.extend((req.classify[c0:c1] + (len(ids) - b)).tolist())
            elif b == len(req.prompt):
                sampled_at.append(len(rows))
                rows.append(len(ids) - 1)
                sampled.append(req)
        meta = AttentionMeta.build(starts, qlens, ctxs, dev, num_decode=len(plan.decode))
        logits = self.model(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.pool, meta,
            logits_rows=torch.tensor(rows, device=dev) if rows else torch.zeros(0, dtype=torch.long, device=dev),
            audio_embeds=torch.cat(audio) if audio else None, kernels=self.kernels,
        )
        for req, n in plan.prefill:
            req.prefilled += n
            if req.prefill_done:
                req.audio = None  # encoder output no longer needed
        tokens = logits.argmax(-1).tolist() if rows else []
        for req, first, m in classified:
            req.classes.extend(tokens[first:first + m])
        return [(req, tokens[i]) for req, i in zip(sampled, sampled_at, strict=True)]
