"""The one place where the engine prepares a model for its device.

``prepare_model`` returns what the engine runs with: the model (never modified), the ``Kernels`` its
forwards are handed, the attention kernels for the KV pool, and a hook for submitting threads. CPU
specifics live in ``engine/cpu/``, CUDA specifics in ``engine/cuda/`` (a token-major KV pool read in place
by varlen attention, pinned uploads, decode graphs in batch buckets), chosen here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS, Kernels

BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class PreparedModel:
    model: Qwen3ASRModel
    kernels: Kernels  # handed to every model forward
    decode_attention: ModuleType | None = None  # native decode attention (also stores the new K/V)
    prefill_attention: ModuleType | None = None  # native prompt-chunk attention
    release_caller_threads: Callable[[], None] = lambda: None  # called by submitting threads
    description: str = "torch"  # which kernels run, for logs and benchmarks
    # the backend's own KV pool and runner, (decoder config, tokens, device, dtype) -> pool and
    # (prepared, pool, feature config, engine config) -> runner; None: engine/kv_cache.KVPool and engine/runner.Runner
    make_pool: Callable[..., Any] | None = None
    make_runner: Callable[..., Any] | None = None
    backend: str = "cpu"


def backend_for(model: Qwen3ASRModel, backend: str = "auto") -> str:
    """``auto``: the model's device type. ``cuda`` on a CPU model runs the CUDA backend's planning, pool
    layout and runner with its portable kernels (how the tests check them on machines without a GPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "cuda" if model.device.type == "cuda" else "cpu"
    if backend == "cpu" and model.device.type != "cpu":
        raise ValueError(f"the cpu backend needs a model on the CPU, this one is on {model.device}")
    return backend


def prepare_model(model: Qwen3ASRModel, native: bool = True, backend: str = "auto") -> PreparedModel:
    """Choose the kernels for the model's device. ``native=False`` keeps to torch ops (same maths)."""
    chosen = backend_for(model, backend)
    if chosen == "cuda":
        from qasr.engine.cuda.prepare import prepare_cuda

        return prepare_cuda(model, native)
    if model.device.type == "cpu":
        from qasr.engine.cpu.prepare import prepare_cpu

        return prepare_cpu(model, native)
    return PreparedModel(model, TORCH_KERNELS, backend="torch")  # another device type: plain torch ops
