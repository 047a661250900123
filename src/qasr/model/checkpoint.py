"""Everything loaded from one checkpoint directory (config, weights, tokenizer, prompt ids, features), and
the device and dtype it is loaded onto."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qasr.audio.features import FeatureConfig
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import GenerationDefaults, ModelConfig
from qasr.model.prompt import SpecialTokens
from qasr.model.tokenizer import Tokenizer
from qasr.model.weights import load_model, resolve_model_dir


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    generation: GenerationDefaults
    features: FeatureConfig
    tokenizer: Tokenizer
    special: SpecialTokens
    model: Qwen3ASRModel  # None when loaded without weights (a server whose engine runs in another process)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def label(self) -> str:
        """"model NAME" or "aligner NAME" for messages: the folder's name, a cached snapshot's hub id."""
        path = self.path
        name = path.parent.parent.name.removeprefix("models--").replace("--", "/") \
            if path.parent.name == "snapshots" else path.name
        return f"{'aligner' if self.config.is_aligner else 'model'} {name}"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def load_checkpoint(name_or_path: str | os.PathLike, device: str | torch.device = "auto",
                    dtype: str | torch.dtype = "auto", weights: bool = True) -> Checkpoint:
    """``weights=False``: the config, tokenizer and features only (``model`` is None)."""
    model_dir = resolve_model_dir(name_or_path)
    config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer.from_dir(model_dir)
    special = SpecialTokens.resolve(tokenizer, config.audio_token_id, config.audio_start_token_id,
                                    config.audio_end_token_id)
    generation = GenerationDefaults.load(model_dir, fallback_eos=(special.im_end, special.endoftext))
    pre = model_dir / "preprocessor_config.json"
    features = FeatureConfig.from_dict(json.loads(pre.read_text())) if pre.exists() else FeatureConfig()
    if not weights:
        return Checkpoint(model_dir, config, generation, features, tokenizer, special, None)  # type: ignore[arg-type]
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model = load_model(model_dir, config, dev, dt)
    return Checkpoint(model_dir, config, generation, features, tokenizer, special, model)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 make bf16 matmuls several times faster than fp32; without them bf16 is slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available in this torch build")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None
