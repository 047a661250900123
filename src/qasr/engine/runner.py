"""One engine step on the device: a packed encoder call, a packed decoder forward, a greedy argmax."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from qasr.audio.features import LogMel
from qasr.engine.backend import PreparedModel
from qasr.engine.kv_cache import KVPool
from qasr.engine.request import Request
from qasr.engine.scheduler import StepPlan

log = logging.getLogger(__name__)


class Runner:
    def __init__(self, prepared: PreparedModel, pool: KVPool, features: LogMel, conv_batch: int = 64) -> None:
        self.model = prepared.model
        self.kernels = prepared.kernels
        self.pool = pool
        self.features = features
        self.conv_batch = conv_batch
        # where a decode row's bits do not depend on its batch, a recomputed token must come out the same
        self.checks_recompute = prepared.row_invariant_decode

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
        for req, first, j, m in batch.recomputed:
            again, before = tokens[first:first + m], req.output[j:j + m]
            if again != before:
                k = next(i for i, (x, y) in enumerate(zip(again, before, strict=True)) if x != y)
                log.warning("qasr: request %d: token %d recomputed after preemption is %d, not %d as made before; "
                            "it keeps the tokens already made", req.id, j + k, again[k], before[k])
        made: list[tuple[Request, int]] = []
        last: dict[int, int | None] = {}  # None once a guess failed
        kept: dict[int, int] = {}
        for req, i, guess in zip(batch.sampled, batch.sampled_at, batch.guesses, strict=True):
            if guess is not None and last[id(req)] != guess:
                last[id(req)] = None
                continue
            req.logprobs.append(logprobs[i])
            made.append((req, tokens[i]))
            last[id(req)] = tokens[i]
            kept[id(req)] = kept.get(id(req), 0) + 1
        return made

    def collect(self, plan: StepPlan) -> StepBatch:
        """The step's rows: decode rows first (a preempted request's made tokens among them: a decode row
        each, as when they were made), then prefill chunks."""
        b = StepBatch()
        for req in plan.decode:
            ctx = req.context - 1
            guesses = plan.drafts.get(id(req), ())
            for j, token in enumerate((req.output[-1], *guesses)):
                b.add_decode_row(req, token, ctx + j, sampled=True, guess=token if j else None)
        spans, reached = [], {}
        for req, n in plan.prefill:
            a = reached.get(id(req), req.prefilled)
            e = reached[id(req)] = a + n
            spans.append((req, a, e))
        prompt_spans = []
        for req, a, e in spans:
            if a < len(req.prompt):  # the scheduler never lets a chunk pass the prompt's end
                prompt_spans.append((req, a, e))
                continue
            ids, first = req.prefill_ids, len(b.rows)
            for p in range(a, e):  # the row at p made the token at p + 1
                b.add_decode_row(req, ids[p], p, sampled=p == req.prefill_len - 1, logits=self.checks_recompute)
            checked = min(e, req.prefill_len - 1) - a
            if self.checks_recompute and checked > 0:
                b.recomputed.append((req, first, a + 1 - len(req.prompt), checked))
        b.num_decode = len(b.ids)
        audio_id = self.model.cfg.audio_token_id
        for req, a, e in prompt_spans:
            base = len(b.ids)
            chunk = req.prompt[a:e]
            b.ids.extend(chunk)
            b.positions.extend(range(a, e))
            b.tables.append(req.blocks)
            b.qlens.append(e - a)
            b.ctxs.append(a)
            lo, hi = int(req.audio_before[a]), int(req.audio_before[e])
            if hi > lo:
                b.audio.append(req.audio[lo:hi])
                b.audio_rows.extend(int(i) + base for i in np.flatnonzero(np.asarray(chunk) == audio_id))
            if req.classify is not None:
                c0, c1 = np.searchsorted(req.classify, [a, e])
                b.classified.append((req, len(b.rows), int(c1 - c0)))
                b.rows.extend((req.classify[c0:c1] + (len(b.ids) - e)).tolist())
            elif e == req.prefill_len:
                b.sampled_at.append(len(b.rows))
                b.rows.append(len(b.ids) - 1)
                b.sampled.append(req)
                b.guesses.append(None)
            elif e == len(req.prompt) and self.checks_recompute:  # it made the first of the kept tokens
                b.recomputed.append((req, len(b.rows), 0, 1))
                b.rows.append(len(b.ids) - 1)
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
    recomputed: list[tuple[Request, int, int, int]] = field(default_factory=list)  # (request, first row, token, count)

    def add_decode_row(self, req: Request, token: int, position: int, sampled: bool, logits: bool = False,
                       guess: int | None = None) -> None:
        """One decode row of ``req``; its logits computed if ``logits`` or ``sampled`` (then its token is made)."""
        self.ids.append(token)
        self.positions.append(position)
        self.tables.append(req.blocks)
        self.qlens.append(1)
        self.ctxs.append(position)
        if sampled:
            self.sampled_at.append(len(self.rows))
            self.sampled.append(req)
            self.guesses.append(guess)
        if sampled or logits:
            self.rows.append(len(self.ids) - 1)

    @property
    def pure_decode(self) -> bool:
        return self.num_decode == len(self.tables) and not self.classified
