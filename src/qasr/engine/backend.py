"""The device seam: what a backend (engine/cpu/, engine/cuda/) hands the engine, typed.

A backend prepares a model once (``PreparedModel``): the kernels every forward is handed, optionally its
own KV pool layout and its own step runner. The engine only sees the protocols below, so the backends
import this module and never the engine or the module that chooses among them (engine/device.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import Kernels

if TYPE_CHECKING:
    from qasr.audio.features import FeatureConfig
    from qasr.engine.config import EngineConfig
    from qasr.engine.kv_blocks import BlockAllocator
    from qasr.engine.request import Request
    from qasr.engine.scheduler import StepPlan
    from qasr.model.config import DecoderConfig


class KVCache(Protocol):
    """A pool of keys and values for ``tokens`` positions, handed out in blocks of ``block_size`` tokens by
    ``allocator``; a forward's attention metadata names each sequence's block table (the layout of that
    metadata is the pool's own: engine/kv_cache.AttentionMeta, engine/cuda/plan.VarlenMeta)."""

    tokens: int
    block_size: int
    allocator: BlockAllocator

    @property
    def nbytes(self) -> int: ...


class StepRunner(Protocol):
    """Runs one engine step on the device: an encoder call over audio slices, then a decoder forward."""

    def encode(self, slices: list[tuple[Request, int]]) -> float: ...

    def forward(self, plan: StepPlan) -> list[tuple[Request, int]]: ...


class PoolFactory(Protocol):
    def __call__(self, cfg: DecoderConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> KVCache: ...


class RunnerFactory(Protocol):
    def __call__(self, prepared: PreparedModel, pool: KVCache, features: FeatureConfig,
                 config: EngineConfig) -> StepRunner: ...


@dataclass(frozen=True)
class PreparedModel:
    model: Qwen3ASRModel
    kernels: Kernels  # handed to every model forward
    decode_attention: ModuleType | None = None  # native decode attention (also stores the new K/V)
    prefill_attention: ModuleType | None = None  # native prompt-chunk attention
    release_caller_threads: Callable[[], None] = lambda: None  # called by submitting threads
    description: str = "torch"  # which kernels run, for logs and benchmarks
    # a prompt row's decoder output does not depend on how the prompt is cut into prefill chunks (row-invariant
    # linears and norms, and a prefill attention that computes each query row alone over its keys in order):
    # a kept KV prefix may then be continued from any position, not only from the prefill chunk grid
    chunk_invariant_prefill: bool = False
    # a decode row's output does not depend on the rows beside it (row-invariant linears, per-row fused norms, a
    # native decode attention that computes each row alone): several decode rows of one sequence in a forward
    # (guessed tokens checked at once, Engine.submit's draft) then give each row the bits of a step of its own
    row_invariant_decode: bool = False
    # the backend's own KV pool and runner; None: engine/kv_cache.KVPool and engine/runner.Runner
    make_pool: PoolFactory | None = None
    make_runner: RunnerFactory | None = None
    backend: str = "cpu"
