"""CUDA preparation: flash varlen attention where it passes its self-test, else the portable one; torch's
linears and convolutions; the token-major pool and the CUDA runner."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from qasr.audio.features import FeatureConfig
from qasr.engine.backend import PreparedModel
from qasr.engine.cuda.attention import choose_attention, flash_attention
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.runner import CudaRunner
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.kernels import TORCH_KERNELS

if TYPE_CHECKING:
    from qasr.engine.config import EngineConfig

log = logging.getLogger(__name__)


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
    mode = graphs_mode(pool.device.type, flash, config.cuda_graphs)
    return CudaRunner(prepared, pool, features, config.conv_batch, graphs=mode, max_rows=config.max_running)


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
