"""CPU preparation: pick the native kernels that passed their self-tests, pack the weights, describe the result."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType

import torch
from torch import nn

from qasr.engine.backend import PreparedModel
from qasr.engine.cpu import native
from qasr.engine.cpu.activation_tables import native_silu_mul
from qasr.engine.cpu.conv import CpuConvs
from qasr.engine.cpu.int8 import KERNEL_DTYPES, Int8Convs
from qasr.engine.cpu.linear import InvariantLinears, OneDnnLinears, onednn_packing_supported
from qasr.engine.cpu.openmp import release_idle_workers
from qasr.engine.cpu.quantized_linears import int4_decoder_linears, int8_linears, same_input_groups
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.decoder import bind_decoder_layers
from qasr.model.kernels import TORCH_KERNELS, Kernels, torch_silu_mul
from qasr.model.weights import return_free_heap

log = logging.getLogger(__name__)
FUSED_NORM_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]
Conv = Callable[[nn.Conv2d, torch.Tensor], torch.Tensor]


def prepare_cpu(model: Qwen3ASRModel, use_native: bool, quantize: str | None = None,
                int8_kernel: ModuleType | None = None, int4_kernel: ModuleType | None = None,
                label: str = "model") -> PreparedModel:
    """The model's kernels for this CPU. ``quantize="int8"``: linears and the 480-channel convolutions in int8
    (int8.py) on ``int8_kernel``, else the native module, else the torch reference (same bits); ``"int4"``: the
    same, with the decoder's linears and LM head in int4 (int4.py)."""
    dtype = model.dtype
    bf16 = dtype == torch.bfloat16
    # bf16: one-pass kernels; float32/float16: torch's ops composed in C++
    ops = native.decoder_ops_kernel() if use_native and dtype in FUSED_NORM_DTYPES else None
    encoder_ops = native.encoder_ops_kernel() if use_native and bf16 else None
    parts = []
    if quantize in ("int8", "int4"):
        if int8_kernel is None and use_native:
            int8_kernel = native_int8_kernel()
        if int4_kernel is None and use_native and quantize == "int4":
            int4_kernel = native.int4_kernel()
        if dtype not in KERNEL_DTYPES:  # float16: the reference
            int8_kernel = int4_kernel = None
        conv = Int8Convs(model, int8_kernel, encoder_ops)
        where = kernel_name(int8_kernel)
        if quantize == "int8":
            linear = int8_linears(model, int8_kernel, same_input_groups(model))
            parts.append(f"int8 W8A8 dynamic linears and encoder convs ({where}; first conv {dtype_name(dtype)})")
        else:
            linear = int4_decoder_linears(model, int8_kernel, int4_kernel, same_input_groups(model))
            if int4_kernel is None:  # exact, but a torch._int_mm per group of 128 features
                log.warning("qasr: quantize='int4' runs on its torch reference here (no native int4 kernel: it "
                            "needs AVX512-VNNI and a compiler): same results, several times slower than "
                            "quantize='int8'")
            parts.append(f"int4 W4A8 decoder linears and LM head (groups of 128; {kernel_name(int4_kernel)}), "
                         f"int8 W8A8 encoder linears and convs ({where}; first conv {dtype_name(dtype)})")
    elif quantize is not None:
        raise ValueError(f"unknown quantize mode {quantize!r}")
    else:
        linear, conv, gemm_name = _float_products(model, use_native, encoder_ops)
        parts.append(gemm_name)
    return_free_heap()  # the packing's scratch, freed, would otherwise stay resident
    rms_norm = norm_rope = None
    silu_mul = torch_silu_mul
    if ops is not None:
        rms_norm, norm_rope = (ops.rms_norm, ops.norm_rope) if bf16 else (ops.rms_norm_ops, ops.norm_rope_ops)
        silu_mul = native_silu_mul(ops) if bf16 else torch_silu_mul
        parts.append("fused norms and SiLU * up" if bf16 else "norms in one call")
    group = getattr(linear, "group", None)
    parts += ["q/k/v and gate/up as one product each"] if group is not None else []
    encoder_attention = native.encoder_attention_kernel() if use_native and bf16 else None
    parts += ["native encoder attention"] if encoder_attention is not None else []
    conv_gelu = getattr(conv, "of_gelu", None)
    parts += ["native first conv; GELU and padding between convs in one pass"] if encoder_ops is not None else []
    kernels = Kernels(linear=linear, conv=conv, rms_norm=rms_norm, norm_rope=norm_rope, conv_gelu=conv_gelu,
                      silu_mul=silu_mul,
                      fused_dtype=None if ops is None else dtype, linear_group=group,
                      encoder_attention=None if encoder_attention is None else encoder_attention.encoder_attention)
    layers = bind_decoder_layers(model.model, kernels)
    if layers is not None:
        kernels = replace(kernels, decoder_layers=layers)
        parts.append("decoder layers bound once")
    decode = native.decode_kernel() if use_native and dtype in (torch.float32, torch.bfloat16) else None
    head_dim = model.cfg.decoder.head_dim
    prefill = native.attention_kernel() if use_native and bf16 and head_dim == 128 else None
    parts += ["native decode attention"] if decode is not None else []
    parts += ["native prefill attention"] if prefill is not None else []
    rows_invariant = ops is not None and _row_invariant(model, linear)
    prepared = PreparedModel(model, kernels, decode, prefill, release_idle_workers, ", ".join(parts),
                             chunk_invariant_prefill=prefill is not None and rows_invariant,
                             # the per-row fused norms are the bf16 ones (float32's compose torch ops)
                             row_invariant_decode=decode is not None and bf16 and rows_invariant)
    log.info("qasr: %s: CPU kernels: %s", label, prepared.description)
    return prepared


def _float_products(model: Qwen3ASRModel, use_native: bool,
                    encoder_ops: ModuleType | None = None) -> tuple[Linear, Conv, str]:
    """The linear and conv in the checkpoint's dtype, and the GEMM's name."""
    dtype = model.dtype
    bf16 = dtype == torch.bfloat16
    gemm = native.linear_kernel() if use_native and bf16 else None
    conv = CpuConvs(model, gemm, encoder_ops) if bf16 else TORCH_KERNELS.conv
    if gemm is not None:
        return InvariantLinears(model, gemm), conv, f"invariant GEMM ({getattr(gemm, 'KIND', gemm.__name__)})"
    if onednn_packing_supported(model.device, dtype):
        return OneDnnLinears(model), conv, "oneDNN prepacked GEMM (not batch-invariant)"
    return TORCH_KERNELS.linear, conv, "torch GEMM"


def _row_invariant(model: Qwen3ASRModel, linear: Linear) -> bool:
    """Whether every decoder linear is row-invariant: the quantized modes, or the invariant GEMM packing them all."""
    if getattr(linear, "kind", None) in ("int8", "int4"):
        return True
    decoder = [m for m in model.model.modules() if isinstance(m, nn.Linear)] + [model.lm_head]
    return isinstance(linear, InvariantLinears) and all(m in linear.packed for m in decoder)


def native_int8_kernel() -> ModuleType | None:
    """The native int8 GEMM module that passed its self-test here, or None (the torch reference runs)."""
    return native.int8_kernel()


def kernel_name(kernel: ModuleType | None) -> str:
    return "torch reference, torch._int_mm" if kernel is None else f"native {getattr(kernel, 'KIND', kernel.__name__)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
