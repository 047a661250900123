"""The CUDA backend's runner: ``engine/runner.py``'s steps with one asynchronous upload per dtype, pure
decode steps replayed as CUDA graphs (graphs.py) and features made on the device. One host sync a step."""

from __future__ import annotations

import numpy as np
import torch

from qasr.audio.features import FeatureConfig, LogMel
from qasr.engine.backend import PreparedModel
from qasr.engine.cuda.graphs import DecodeGraphs
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import decode_buckets, upload_meta
from qasr.engine.kv_blocks import contiguous_start
from qasr.engine.runner import Runner, StepBatch, pick, read_back


class DeviceFeatures:
    """Log-mel on the model's device; the waveform goes up through pinned memory, asynchronously."""

    def __init__(self, config: FeatureConfig, device: torch.device) -> None:
        self.device = device
        self.logmel = LogMel(config, device)

    def __call__(self, waveform: np.ndarray | torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(waveform, dtype=torch.float32)
        if self.device.type == "cuda" and x.device.type == "cpu":
            x = x.contiguous().pin_memory().to(self.device, non_blocking=True)
        return self.logmel(x)


class CudaRunner(Runner):
    def __init__(self, prepared: PreparedModel, pool: TokenKVPool, features: FeatureConfig, conv_batch: int,
                 graphs: str = "off", max_rows: int = 64) -> None:
        """``graphs``: "capture" (a CUDA graph per decode bucket), "eager" (the same bucketed steps without
        capture, as the CPU tests run) or "off"."""
        super().__init__(prepared, pool, DeviceFeatures(features, pool.device), conv_batch)
        if graphs not in ("capture", "eager", "off"):
            raise ValueError(f"graphs must be capture, eager or off, got {graphs!r}")
        self.graphs = None if graphs == "off" else DecodeGraphs(
            self.model, pool, self.kernels, decode_buckets(max_rows), capture=graphs == "capture")
        if self.graphs is not None:  # captured before any request's thread can run
            with torch.inference_mode():
                self.graphs.prepare()
        self.eager_steps = 0
        self.scattered_decode_steps = 0

    def run(self, batch: StepBatch) -> tuple[list[int], list[float]]:
        if self.graphs is not None and batch.pure_decode:
            # a graph reads the pool in place
            bs = self.pool.block_size
            starts = [contiguous_start(t, bs, c + 1) for t, c in zip(batch.tables, batch.ctxs, strict=True)]
            if all(s is not None for s in starts):
                sampled = self.graphs.run(batch.ids, batch.positions, starts, batch.ctxs)
                if sampled is not None:
                    return sampled
            else:
                self.scattered_decode_steps += 1
        self.eager_steps += 1
        dev = self.model.device
        meta, (ids, positions, rows, audio_rows) = upload_meta(
            batch.tables, self.pool.block_size, batch.qlens, batch.ctxs, batch.num_decode, dev,
            batch.ids, batch.positions, batch.rows, batch.audio_rows)
        logits = self.model(ids, positions, self.pool, meta, logits_rows=rows,
                            audio_embeds=torch.cat(batch.audio) if batch.audio else None, kernels=self.kernels,
                            audio_rows=audio_rows if batch.audio else None)
        return read_back(*pick(logits)) if batch.rows else ([], [])

    def stats(self) -> dict:
        """How the decode steps ran, for benchmarks and logs."""
        g = self.graphs
        return dict(eager_steps=self.eager_steps, scattered_decode_steps=self.scattered_decode_steps,
                    bucketed_steps=g.steps if g else 0,
                    graph_replays=g.replays if g else 0, graph_buckets=list(g.buckets) if g else [],
                    graph_failed=g.failed if g else None, graph_capture_s=g.capture_s if g else 0.0)
