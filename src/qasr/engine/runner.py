"""One engine step on the device: a packed encoder call, a packed decoder forward, a greedy argmax."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from qasr.audio.features import LogMel
from qasr.engine.backend import PreparedModel
from qasr.engine.kv_cache import KVPool
from qasr.engine.request import Request
from qasr.engine.scheduler import StepPlan


class Runner:
    def __init__(self, prepared: PreparedModel, pool: KVPool, features: LogMel, conv_batch: int = 64) -> None:
        self.model = prepared.model
        self.kernels = prepared.kernels
        self.pool = pool
        self.features = features
        self.conv_batch = conv_batch

    @torch.inference_mode()
    def encode(self, slices: list[tuple[Request, int]]) -> float:
        """Encode ``n`` more audio tokens of each request in one call, all or none; returns features' seconds."""
        enc = self.model.cfg.encoder
        window_frames = enc.window_tokens // enc.tokens_per_conv_chunk * enc.conv_chunk_frames
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
        heads = [req.conv_head for req, _ in slices]
        run = self.model.audio_tower.encode(feats, heads, conv_batch=self.conv_batch, kernels=self.kernels)
        outs = run.rows
        for (req, n), out in zip(slices, outs, strict=True):
            if out.shape[0] != n:
                raise ValueError(f"request {req.id}: encoder gave {out.shape[0]} tokens for a slice of {n}")
        for (req, n), out, conv in zip(slices, outs, run.conv, strict=True):
            if req.encode_only:
                req.conv = conv
            if req.audio is None:
                req.audio = out.new_empty((req.audio_tokens, out.shape[1]))
            req.audio[req.encoded_tokens:req.encoded_tokens + n] = out
            req.encoded_tokens += n
            if req.encoded:
                req.features = None
        return feat_s

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> list[tuple[Request, int]]:
        """Run the plan; (request, token) for each token made, in order. Fills ``req.logprobs`` and an alignment
        request's ``req.classes``."""
        batch = self.collect(plan)
        tokens, logprobs = self.run(batch)  # also when nothing is sampled: it stores the keys and values
        for req, n in plan.prefill:
            req.prefilled += n
        for req, first, m in batch.classified:
            req.classes.extend(tokens[first:first + m])
        made: list[tuple[Request, int]] = []
        last: dict[int, int | None] = {}  # None once a guess failed
        kept: dict[int, int] = {}
        for req, i, guess in zip(batch.sampled, batch.sampled_at, batch.guesses, strict=True):
            if guess is not None and last[id(req)] != guess:
                last[id(req)] = None
                continue
            k = len(req.output) + kept.get(id(req), 0)
            del req.logprobs[k:]  # a recomputation overwrites
            req.logprobs.append(logprobs[i])
            made.append((req, tokens[i]))
            last[id(req)] = tokens[i]
            kept[id(req)] = kept.get(id(req), 0) + 1
        return made

    def collect(self, plan: StepPlan) -> StepBatch:
        b = StepBatch()
        for req in plan.decode:
            ctx = len(req.prompt) + len(req.output) - 1
            guesses = plan.drafts.get(id(req), ())
            for j, token in enumerate((req.output[-1], *guesses)):
                b.ids.append(token)
                b.positions.append(ctx + j)
                b.tables.append(req.blocks)
                b.qlens.append(1)
                b.ctxs.append(ctx + j)
                b.sampled_at.append(len(b.rows))
                b.rows.append(len(b.ids) - 1)
                b.sampled.append(req)
                b.guesses.append(token if j else None)
        b.num_decode = len(b.ids)
        audio_id = self.model.cfg.audio_token_id
        reached: dict[int, int] = {}
        for req, n in plan.prefill:
            a = reached.get(id(req), req.prefilled)
            e = reached[id(req)] = a + n
            base = len(b.ids)
            chunk = req.prompt[a:e]
            b.ids.extend(chunk)
            b.positions.extend(range(a, e))
            b.tables.append(req.blocks)
            b.qlens.append(n)
            b.ctxs.append(a)
            lo, hi = int(req.audio_before[a]), int(req.audio_before[e])
            if hi > lo:
                b.audio.append(req.audio[lo:hi])
                b.audio_rows.extend(int(i) + base for i in np.flatnonzero(np.asarray(chunk) == audio_id))
            if req.classify is not None:
                c0, c1 = np.searchsorted(req.classify, [a, e])
                b.classified.append((req, len(b.rows), int(c1 - c0)))
                b.rows.extend((req.classify[c0:c1] + (len(b.ids) - e)).tolist())
            elif e == len(req.prompt):
                b.sampled_at.append(len(b.rows))
                b.rows.append(len(b.ids) - 1)
                b.sampled.append(req)
                b.guesses.append(None)
        return b

    def run(self, batch: StepBatch) -> tuple[list[int], list[float]]:
        """One packed decoder forward; each of ``batch.rows``' argmax and log-probability."""
        dev = self.model.device
        meta = self.pool.build_meta(batch.tables, batch.qlens, batch.ctxs, batch.num_decode)
        rows = torch.tensor(batch.rows, dtype=torch.long, device=dev)
        logits = self.model(
            torch.tensor(batch.ids, device=dev), torch.tensor(batch.positions, device=dev), self.pool, meta,
            logits_rows=rows, audio_embeds=torch.cat(batch.audio) if batch.audio else None, kernels=self.kernels,
            audio_rows=torch.tensor(batch.audio_rows, dtype=torch.long, device=dev) if batch.audio else None,
        )
        return read_back(*pick(logits)) if batch.rows else ([], [])


def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and its float32 log-softmax there; a row does not depend on its neighbours."""
    scores = logits.float()  # exact; cheaper than a bf16 argmax (docs/log/, engine-argmax-float32)
    tokens = scores.argmax(-1, keepdim=True)
    logprobs = torch.log_softmax(scores, -1).gather(-1, tokens)
    return tokens.squeeze(-1), logprobs.squeeze(-1)


def read_back(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Both to the host in one sync (float64 holds any id and any float32)."""
    ids, lps = torch.stack([tokens.double(), logprobs.double()]).tolist()
    return [int(t) for t in ids], lps


@dataclass
class StepBatch:
    num_decode: int = 0  # leading one-token rows
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # per sequence: block table, new tokens, cached tokens
    qlens: list[int] = field(default_factory=list)
    ctxs: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)
    audio_rows: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows whose logits are computed
    sampled: list[Request] = field(default_factory=list)  # per sampled row: request, index in rows, guess
    sampled_at: list[int] = field(default_factory=list)
    guesses: list[int | None] = field(default_factory=list)
    classified: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, first row, count)

    @property
    def pure_decode(self) -> bool:
        return self.num_decode == len(self.tables) and not self.classified
