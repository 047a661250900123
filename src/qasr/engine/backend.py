"""What a backend (engine/cpu/, engine/cuda/) hands the engine: a ``PreparedModel``. Backends import this
module, never the engine or engine/device.py."""

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
    """Keys and values for ``tokens`` positions, handed out in blocks by ``allocator``."""

    tokens: int
    block_size: int
    allocator: BlockAllocator

    @property
    def nbytes(self) -> int: ...


class StepRunner(Protocol):

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
    decode_attention: ModuleType | None = None
    prefill_attention: ModuleType | None = None
    release_caller_threads: Callable[[], None] = lambda: None  # called by submitting threads
    description: str = "torch"  # which kernels run, for logs
    # a prompt row's bits do not depend on the prefill chunking
    chunk_invariant_prefill: bool = False
    # a decode row's bits do not depend on the rows beside it
    row_invariant_decode: bool = False
    # None: engine/kv_cache.KVPool and engine/runner.Runner
    make_pool: PoolFactory | None = None
    make_runner: RunnerFactory | None = None
    backend: str = "cpu"
