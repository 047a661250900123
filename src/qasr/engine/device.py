"""The one place that chooses a backend (engine/cpu/, engine/cuda/) and prepares a model for it."""

from __future__ import annotations

import weakref

from qasr.engine.backend import PreparedModel
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS

BACKENDS = ("auto", "cpu", "cuda")
_prepared: weakref.WeakKeyDictionary[Qwen3ASRModel, dict[tuple[str, bool, str | None], PreparedModel]] = \
    weakref.WeakKeyDictionary()


def backend_for(model: Qwen3ASRModel, backend: str = "auto") -> str:
    """``auto``: the model's device type; ``cuda`` on a CPU model runs the portable CUDA paths."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "cuda" if model.device.type == "cuda" else "cpu"
    if backend == "cpu" and model.device.type != "cpu":
        raise ValueError(f"the cpu backend needs a model on the CPU, this one is on {model.device}")
    return backend


def prepare_model(model: Qwen3ASRModel, native: bool = True, backend: str = "auto",
                  quantize: str | None = None, label: str = "model") -> PreparedModel:
    """The model prepared for its backend (never modified), shared by every engine on it. ``native=False``
    keeps to torch ops; ``quantize`` ("int8", "int4") is CPU only; ``label`` names the model in the log."""
    chosen = backend_for(model, backend)
    if quantize is not None and (chosen != "cpu" or model.device.type != "cpu"):
        raise ValueError(f"quantize={quantize!r} runs on the CPU backend only (no {chosen} {quantize} kernels yet): "
                         "load the model on the CPU, or leave quantize off")
    cached = _prepared.setdefault(model, {})
    key = (chosen, native, quantize)
    if key not in cached:
        cached[key] = _prepare(model, native, chosen, quantize, label)
    return cached[key]


def _prepare(model: Qwen3ASRModel, native: bool, chosen: str, quantize: str | None, label: str) -> PreparedModel:
    if chosen == "cuda":
        from qasr.engine.cuda.prepare import prepare_cuda

        return prepare_cuda(model, native, label)
    if model.device.type == "cpu":
        from qasr.engine.cpu.prepare import prepare_cpu

        return prepare_cpu(model, native, quantize, label=label)
    return PreparedModel(model, TORCH_KERNELS, backend="torch")
