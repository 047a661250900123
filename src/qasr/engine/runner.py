"""Executes one engine step on the device: packed encoder call, then one packed decoder forward
(decode rows first, prefill chunks after) and a greedy argmax, with each chosen token's
log-probability, read back in a single host sync."""

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
        # log-probabilities of the requests' generated tokens: entry i for ``req.output[i]``, written when the
        # token is sampled (a preempted request's recomputation writes the same values over the old ones);
        # the engine takes a request's list when it ends, and a request dropped otherwise drops its entry

    @torch.inference_mode()
    def encode(self, slices: list[tuple[Request, int]]) -> float:
        """One packed encoder call over a slice of each request's audio: ``n`` tokens from its
        ``encoded_tokens`` on, which lies on the 8 s window grid (windows attend only within
        themselves, so a slice's output equals those rows of the whole). Features are made at a
        request's first slice (the log-mel needs the whole utterance) and dropped after its last.
        Nothing is changed unless the whole call succeeds. Returns the seconds spent on features."""
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
        heads = [req.conv_head for req, _ in slices]  # (a request with a conv head is one window, one slice)
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
        """Run decode rows and prefill chunks together; return (request, next token) for every request
        whose logits were computed (all decode rows, and prefill chunks that complete their prompt); each
        token's log-probability goes to ``req.logprobs``. Alignment requests get the head's argmax at their
        classifier positions in ``req.classes``."""
        batch = self.collect(plan)
        tokens, logprobs = self.run(batch)  # runs even when no row is sampled: the chunks' keys and values are stored
        for req, n in plan.prefill:
            req.prefilled += n  # the encoder output stays: a preempted request prefills again from it
        for req, first, m in batch.classified:
            req.classes.extend(tokens[first:first + m])
        made: list[tuple[Request, int]] = []
        last: dict[int, int | None] = {}  # by request: the token of its last row kept (None: a guess failed)
        kept: dict[int, int] = {}  # by request: tokens kept so far this step
        for req, i, guess in zip(batch.sampled, batch.sampled_at, batch.guesses, strict=True):
            if guess is not None and last[id(req)] != guess:
                last[id(req)] = None  # this row was fed a wrong guess (or follows one): its token is not the output's
                continue
            k = len(req.output) + kept.get(id(req), 0)  # the token made now is output[k]
            del req.logprobs[k:]  # a recomputation overwrites
            req.logprobs.append(logprobs[i])
            made.append((req, tokens[i]))
            last[id(req)] = tokens[i]
            kept[id(req)] = kept.get(id(req), 0) + 1
        return made

    def collect(self, plan: StepPlan) -> StepBatch:
        """The step's packed rows, on the host: decode rows first, then prefill chunks in plan order."""
        b = StepBatch()
        for req in plan.decode:
            # the newest token, then the guesses (plan.drafts) as if each had been made: a row of its own each, a
            # decode row like any other (row-invariant kernels give it the bits of a step of its own)
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
        reached: dict[int, int] = {}  # a request's later chunks in this step start where its earlier ones end
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
            if req.classify is not None:  # alignment: the head runs only at its positions in [a, e)
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
        """One packed decoder forward on the device; the argmax of each row in ``batch.rows`` and its
        log-probability (read back together: the step's single host sync)."""
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
    """Greedy choice on the device: each row's argmax (int64) and its log-probability, the float32
    log-softmax of the row at that id. log_softmax over the last dim reduces every row by itself (one
    CPU thread or one CUDA block a row, in an order set by the vocabulary size alone), so a row's value
    does not depend on the rows beside it, and a recomputed row gives the same bits."""
    scores = logits.float()  # exact (bf16 and float16 are subsets of float32)
    # the argmax of the float32 values is the argmax of the logits (the same order, ties to the first index, NaN
    # the largest), and on the CPU it costs a quarter of torch's bf16 argmax: 0.39 against 1.67 ms at 5 rows of the
    # 151,936-token vocabulary (2 Zen 4 cores), once a decode step
    tokens = scores.argmax(-1, keepdim=True)  # (rows, 1)
    logprobs = torch.log_softmax(scores, -1).gather(-1, tokens)
    return tokens.squeeze(-1), logprobs.squeeze(-1)


def read_back(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Both to the host in one transfer (one sync): stacked as float64, which holds any token id and any
    float32 exactly."""
    ids, lps = torch.stack([tokens.double(), logprobs.double()]).tolist()
    return [int(t) for t in ids], lps


@dataclass
class StepBatch:
    """One step's packed decoder rows, built on the host by ``Runner.collect``."""

    num_decode: int = 0  # leading single-token decode rows (a request's guessed tokens each bring one)
    ids: list[int] = field(default_factory=list)  # (N,) token ids, packed
    positions: list[int] = field(default_factory=list)  # (N,) absolute positions
    tables: list[list[int]] = field(default_factory=list)  # per sequence: its KV block table
    qlens: list[int] = field(default_factory=list)  # per sequence: new tokens
    ctxs: list[int] = field(default_factory=list)  # per sequence: tokens already cached
    audio: list[torch.Tensor] = field(default_factory=list)  # encoder rows for the audio placeholders, in order
    audio_rows: list[int] = field(default_factory=list)  # packed rows of the audio placeholders
    rows: list[int] = field(default_factory=list)  # packed rows whose logits are computed
    sampled: list[Request] = field(default_factory=list)  # requests that get a token this step
    sampled_at: list[int] = field(default_factory=list)  # index in ``rows`` of each sampled request's row
    guesses: list[int | None] = field(default_factory=list)  # per sampled row: the guessed id it was fed, or None
    classified: list[tuple[Request, int, int]] = field(default_factory=list)  # (alignment request, first, count)

    @property
    def pure_decode(self) -> bool:
        return self.num_decode == len(self.tables) and not self.classified
