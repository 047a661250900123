"""The one place where the engine prepares a model for its device.

``prepare_model`` returns what the engine runs with: the model (never modified), the ``Kernels`` its
forwards are handed, the attention kernels for the KV pool, and a hook for submitting threads. CPU
specifics live in ``engine/cpu/``; a CUDA backend will live in ``engine/cuda/`` and be chosen here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS, Kernels


@dataclass(frozen=True)
class PreparedModel:
    model: Qwen3ASRModel
    kernels: Kernels  # handed to every model forward
    decode_attention: ModuleType | None = None  # native decode attention (also stores the new K/V)
    prefill_attention: ModuleType | None = None  # native prompt-chunk attention
    release_caller_threads: Callable[[], None] = lambda: None  # called by submitting threads
    description: str = "torch"  # which kernels run, for logs and benchmarks


def prepare_model(model: Qwen3ASRModel, native: bool = True) -> PreparedModel:
    """Choose the kernels for the model's device. ``native=False`` keeps to torch ops (same maths)."""
    if model.device.type == "cpu":
        from qasr.engine.cpu.prepare import prepare_cpu

        return prepare_cpu(model, native)
    return PreparedModel(model, TORCH_KERNELS)
