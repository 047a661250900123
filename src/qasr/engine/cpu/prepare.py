"""CPU preparation: pick the native kernels this CPU passed its self-tests with, pack the weights for
them, and describe the result. engine/device.py keeps the result per model, so a second engine on the
same checkpoint reuses the packed weights instead of packing (and holding) another copy."""

from __future__ import annotations

import logging

import torch

from qasr.engine.backend import PreparedModel
from qasr.engine.cpu import native
from qasr.engine.cpu.conv import CpuConvs
from qasr.engine.cpu.linear import InvariantLinears, OneDnnLinears, onednn_packing_supported
from qasr.engine.cpu.openmp import release_idle_workers
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS, Kernels

log = logging.getLogger(__name__)


def prepare_cpu(model: Qwen3ASRModel, use_native: bool) -> PreparedModel:
    dtype = model.dtype
    bf16 = dtype == torch.bfloat16
    gemm = native.linear_kernel() if use_native and bf16 else None
    ops = native.decoder_ops_kernel() if use_native and bf16 else None
    parts = []
    if gemm is not None:
        linear = InvariantLinears(model, gemm)
        parts.append(f"invariant GEMM ({getattr(gemm, 'KIND', gemm.__name__)})")
    elif onednn_packing_supported(model.device, dtype):
        linear = OneDnnLinears(model)
        parts.append("oneDNN prepacked GEMM (not batch-invariant)")
    else:
        linear = TORCH_KERNELS.linear
        parts.append("torch GEMM")
    kernels = Kernels(
        linear=linear,
        conv=CpuConvs(model, gemm) if bf16 else TORCH_KERNELS.conv,
        rms_norm=None if ops is None else ops.rms_norm,
        norm_rope=None if ops is None else ops.norm_rope,
        fused_dtype=torch.bfloat16 if ops is not None else None,
    )
    if ops is not None:
        parts.append("fused norms")
    decode = native.decode_kernel() if use_native and dtype in (torch.float32, torch.bfloat16) else None
    head_dim = model.cfg.decoder.head_dim
    prefill = native.attention_kernel() if use_native and bf16 and head_dim == 128 else None
    parts += ["native decode attention"] if decode is not None else []
    parts += ["native prefill attention"] if prefill is not None else []
    prepared = PreparedModel(model, kernels, decode, prefill, release_idle_workers, ", ".join(parts))
    log.info("qasr: CPU kernels: %s", prepared.description)
    return prepared
