"""The CUDA backend's runner: ``engine/runner.py``'s steps with their uploads through reused pinned staging, pure
decode steps replayed as CUDA graphs (graphs.py), features made on the device, and the audio rows a step reads
checked for NaN and infinity on the device. One host sync a step: the read-back of its sampled rows."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from qasr.audio.features import FeatureConfig, LogMel
from qasr.engine.backend import PreparedModel
from qasr.engine.cuda.graphs import DecodeGraphs
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import PinnedStaging, context_buckets, decode_buckets, upload_meta
from qasr.engine.request import Request
from qasr.engine.runner import Runner, StepBatch, pick
from qasr.engine.scheduler import StepPlan


class DeviceFeatures:
    """Log-mel on the model's device; the waveform goes up through the runner's pinned staging, asynchronously."""

    def __init__(self, config: FeatureConfig, staging: PinnedStaging) -> None:
        self.staging = staging
        self.logmel = LogMel(config, staging.device)

    def __call__(self, waveform: np.ndarray | torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(waveform, dtype=torch.float32)
        if x.device != self.staging.device:
            x = self.staging.upload(x)
        return self.logmel(x)


class NonFiniteAudio(ValueError):
    """A request's audio rows (its audio_embeds, or the encoder's output) hold NaN or infinity."""


class CudaRunner(Runner):
    def __init__(self, prepared: PreparedModel, pool: TokenKVPool, features: FeatureConfig, conv_batch: int,
                 graphs: str = "off", max_rows: int = 64, max_positions: int | None = None) -> None:
        """``graphs``: "capture" (a CUDA graph per decode bucket), "eager" (the same bucketed steps without
        capture, as the CPU tests run) or "off"; ``max_positions``: the model's longest sequence (context
        buckets stop there)."""
        self.staging = PinnedStaging(pool.device)
        super().__init__(prepared, pool, DeviceFeatures(features, self.staging), conv_batch)
        if graphs not in ("capture", "eager", "off"):
            raise ValueError(f"graphs must be capture, eager or off, got {graphs!r}")
        self.graphs = None
        if graphs != "off":
            capacity = min(pool.tokens, max_positions or pool.tokens)
            self.graphs = DecodeGraphs(self.model, pool, self.kernels, decode_buckets(max_rows),
                                       context_buckets(capacity, pool.block_size), graphs == "capture",
                                       self.staging, split_slots(pool.device))
            with torch.inference_mode():  # captured before any request's thread can run
                self.graphs.prepare()
        self.eager_steps = 0
        # per request: audio rows checked so far, and the flag of those not yet read back (None: all read)
        self._checked: weakref.WeakKeyDictionary[Request, tuple[int, torch.Tensor | None]] = \
            weakref.WeakKeyDictionary()
        self._pending: list[tuple[Request, torch.Tensor]] = []

    @torch.inference_mode()
    def encode(self, slices: list[tuple[Request, int]]) -> float:
        for req, _ in slices:  # host features (a live window) go up asynchronously, not by a blocking copy
            if req.features is not None and req.features.device != self.staging.device:
                req.features = self.staging.upload(req.features.float())
        return super().encode(slices)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> list[tuple[Request, int]]:
        self._pending = self._check_audio(plan)
        return super().forward(plan)

    def _check_audio(self, plan: StepPlan) -> list[tuple[Request, torch.Tensor]]:
        """A device flag per prefilling request: are its encoded rows finite? Computed on the device as rows
        arrive, read back with the next sampled rows of a step the request is in."""
        pending = []
        for req in dict.fromkeys(req for req, _ in plan.prefill):
            if req.audio is None:
                continue
            upto, flag = self._checked.get(req, (0, None))
            if req.encoded_tokens > upto:
                new = torch.isfinite(req.audio[upto:req.encoded_tokens]).all()
                flag = new if flag is None else flag & new
                self._checked[req] = (req.encoded_tokens, flag)
            if flag is not None:
                pending.append((req, flag))
        return pending

    def run(self, batch: StepBatch) -> tuple[list[int], list[float]]:
        if self.graphs is not None and batch.pure_decode:
            sampled = self.graphs.run(batch.ids, batch.positions, batch.tables, batch.ctxs)
            if sampled is not None:  # a graph samples every row; the step wants those of batch.rows
                tokens, logprobs = sampled
                return [tokens[r] for r in batch.rows], [logprobs[r] for r in batch.rows]
        self.eager_steps += 1
        meta, (ids, positions, rows, audio_rows) = upload_meta(
            self.staging, batch.tables, self.pool.block_size, batch.qlens, batch.ctxs, batch.num_decode,
            batch.ids, batch.positions, batch.rows, batch.audio_rows)
        logits = self.model(ids, positions, self.pool, meta, logits_rows=rows,
                            audio_embeds=torch.cat(batch.audio) if batch.audio else None, kernels=self.kernels,
                            audio_rows=audio_rows if batch.audio else None)
        return self._read_back(*pick(logits)) if batch.rows else ([], [])

    def _read_back(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
        """Tokens, log-probabilities and the pending audio flags in one sync; NonFiniteAudio when a flag is
        false (the engine then reruns the step a request at a time, and that request fails)."""
        n = tokens.shape[0]
        parts = [tokens.double(), logprobs.double(), *(f.double().reshape(1) for _, f in self._pending)]
        values = torch.cat(parts).tolist()
        for (req, _), ok in zip(self._pending, values[2 * n:], strict=True):
            if not ok:
                raise NonFiniteAudio(f"request {req.id}: its audio rows (audio_embeds, or the encoder's output) "
                                     "hold NaN or infinity")
        for req, _ in self._pending:
            self._checked[req] = (self._checked[req][0], None)
        self._pending = []
        return [int(t) for t in values[:n]], values[n:2 * n]

    def stats(self) -> dict:
        """How the decode steps ran, for benchmarks and logs."""
        g = self.graphs
        return dict(eager_steps=self.eager_steps, bucketed_steps=g.steps if g else 0,
                    graph_replays=g.replays if g else 0, graph_buckets=list(g.buckets) if g else [],
                    graph_context_buckets=list(g.context_buckets) if g else [],
                    graph_failed=g.failed if g else None, graph_capture_s=g.capture_s if g else 0.0,
                    staging_bytes=self.staging.nbytes)


def split_slots(device: torch.device) -> int:
    """Twice the device's SM count (the tasks one wave of split attention runs); 264 (an H100's) off CUDA."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 264
