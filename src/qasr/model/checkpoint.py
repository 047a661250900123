"""Everything loaded from one checkpoint directory: config, weights, tokenizer, prompt ids, features."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qasr.audio.features import FeatureConfig
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import GenerationDefaults, ModelConfig
from qasr.model.device import resolve_device, resolve_dtype
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
    model: Qwen3ASRModel

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def load_checkpoint(name_or_path: str | os.PathLike, device: str | torch.device = "auto",
                    dtype: str | torch.dtype = "auto") -> Checkpoint:
    model_dir = resolve_model_dir(name_or_path)
    config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer.from_dir(model_dir)
    special = SpecialTokens.resolve(tokenizer, config.audio_token_id, config.audio_start_token_id,
                                    config.audio_end_token_id)
    generation = GenerationDefaults.load(model_dir, fallback_eos=(special.im_end, special.endoftext))
    pre = model_dir / "preprocessor_config.json"
    features = FeatureConfig.from_dict(json.loads(pre.read_text())) if pre.exists() else FeatureConfig()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model = load_model(model_dir, config, dev, dt)
    return Checkpoint(model_dir, config, generation, features, tokenizer, special, model)
