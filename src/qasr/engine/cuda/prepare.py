"""CUDA preparation: flash varlen attention where it passes its self-test, else the portable one; torch's
linears and convolutions; the paged pool and the CUDA runner; the settings a GPU wants (``cuda_defaults``)."""

from __future__ import annotations

import dataclasses
import functools
import logging

from qasr.audio.features import FeatureConfig
from qasr.engine.backend import PreparedModel
from qasr.engine.config import EngineConfig
from qasr.engine.cuda.attention import choose_attention, flash_attention
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import FLASH_BLOCK_TOKENS
from qasr.engine.cuda.runner import CudaRunner
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS

log = logging.getLogger(__name__)
# what a GPU runs best where the CPU default was left: KV blocks flash's paged path reads, steps that fill the
# device (a budget with room for max_running decode rows beside 8k prompt tokens and encoder rows, 1 s chunks
# per conv call) and more requests at once
GPU_DEFAULTS = dict(kv_block_tokens=FLASH_BLOCK_TOKENS, step_tokens=8448, conv_batch=64, max_running=256)


def cuda_defaults(config: EngineConfig) -> EngineConfig:
    """``config`` with each of ``GPU_DEFAULTS``' fields that is still at its CPU default replaced; fields a
    user set to anything else are kept."""
    cpu = EngineConfig()
    changes = {name: value for name, value in GPU_DEFAULTS.items() if getattr(config, name) == getattr(cpu, name)}
    return dataclasses.replace(config, **changes)


def graphs_mode(device_type: str, flash: bool, wanted: bool) -> str:
    """Capture needs CUDA and flash (the portable attention's shapes follow the context); on the CPU the
    bucketed steps run eagerly, so the tests check them."""
    if not wanted:
        return "off"
    if device_type == "cuda":
        return "capture" if flash else "off"
    return "eager"


def make_runner(prepared: PreparedModel, pool: TokenKVPool, features: FeatureConfig, config: EngineConfig,
                flash: bool = False) -> CudaRunner:
    # an aligner's requests are prompts alone: it never decodes, so it captures no decode graphs
    mode = graphs_mode(pool.device.type, flash, config.cuda_graphs and not prepared.model.cfg.is_aligner)
    return CudaRunner(prepared, pool, features, config.conv_batch, graphs=mode, max_rows=config.max_running,
                      max_positions=prepared.model.cfg.decoder.max_position_embeddings)


def prepare_cuda(model: Qwen3ASRModel, native: bool = True, label: str = "model") -> PreparedModel:
    """``native=False`` keeps to the portable attention (no flash, no graphs)."""
    dec = model.cfg.decoder
    if native:
        attention, what = choose_attention(model.device, model.dtype, dec.num_attention_heads,
                                           dec.num_key_value_heads, dec.head_dim)
    else:
        from qasr.engine.cuda.attention import reference_attention

        attention, what = reference_attention, "portable padded attention (native kernels off)"
    flash = attention is flash_attention
    prepared = PreparedModel(model, TORCH_KERNELS, description=f"torch GEMM, {what}",
                             make_pool=functools.partial(TokenKVPool, attention=attention),
                             make_runner=functools.partial(make_runner, flash=flash), backend="cuda")
    log.info("qasr: %s: CUDA backend on %s: %s", label, model.device, prepared.description)
    return prepared
