"""Tiny random checkpoints in the released models' file layouts ("original" or "-hf"; one seed, the same
weights in both), with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from qasr.align.units import ALIGNER_LANGUAGES
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import ModelConfig
from qasr.testing.tokenizer_files import write_tiny_tokenizer

TINY_DIMS: dict[str, int] = dict(
    d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128, downsample_hidden_size=16,
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,
)

# the real Qwen3-ASR-0.6B dimensions
QWEN3_ASR_0_6B_DIMS: dict[str, int] = dict(
    d_model=896, encoder_layers=18, encoder_attention_heads=14, encoder_ffn_dim=3584, downsample_hidden_size=480,
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936,
)

_HF_RENAMES = (
    ("audio_tower.proj1.", "model.multi_modal_projector.linear_1."),
    ("audio_tower.proj2.", "model.multi_modal_projector.linear_2."),
    ("audio_tower.", "model.audio_tower."),
    ("model.", "model.language_model."),
    ("lm_head.", "lm_head."),
)



def _configs(dims: dict[str, int], specials: dict[str, int], vocab_size: int,
             tied: bool, classify_num: int | None = None) -> tuple[dict, dict]:
    audio = dict(
        model_type="qwen3_asr_audio_encoder", num_mel_bins=128, d_model=dims["d_model"],
        encoder_layers=dims["encoder_layers"], encoder_attention_heads=dims["encoder_attention_heads"],
        encoder_ffn_dim=dims["encoder_ffn_dim"], output_dim=dims["hidden_size"], n_window=50,
        n_window_infer=800, conv_chunksize=500, downsample_hidden_size=dims["downsample_hidden_size"],
        activation_function="gelu", scale_embedding=False, max_source_positions=1500,
    )
    text = dict(
        model_type="qwen3", vocab_size=vocab_size, hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"], num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"], rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=65536,
        tie_word_embeddings=tied, attention_bias=False, hidden_act="silu",
    )
    langs = ["Chinese", "English", "Cantonese", "German", "French", "Spanish"]
    original = dict(
        architectures=["Qwen3ASRForConditionalGeneration"], model_type="qwen3_asr", support_languages=langs,
        thinker_config=dict(
            model_type="qwen3_asr_thinker", audio_config=audio,
            text_config=dict(text, rope_scaling={"mrope_section": [dims["head_dim"] // 4] * 2,
                                                 "mrope_interleaved": True, "interleaved": True,
                                                 "rope_type": "default", "type": "default"}),
            audio_token_id=specials["<|audio_pad|>"], audio_start_token_id=specials["<|audio_start|>"],
            audio_end_token_id=specials["<|audio_end|>"], dtype="float32",
        ),
    )
    hf_audio = {k: v for k, v in audio.items() if k not in ("conv_chunksize", "max_source_positions")}
    hf_text = {k: v for k, v in text.items() if k != "rope_theta"}
    hf = dict(
        architectures=["Qwen3ASRForConditionalGeneration"], model_type="qwen3_asr",
        audio_config=dict(hf_audio, model_type="qwen3_asr_encoder", max_position_embeddings=13),
        text_config=dict(hf_text, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        audio_token_id=specials["<|audio_pad|>"], timestamp_token_id=specials["<timestamp>"],
        pad_token_id=specials["<|im_end|>"], eos_token_id=[specials["<|endoftext|>"], specials["<|im_end|>"]],
        tie_word_embeddings=tied,
    )
    if classify_num is not None:
        _make_aligner(original, hf, specials["<timestamp>"], classify_num)
    return original, hf


def _make_aligner(original: dict, hf: dict, timestamp_id: int, classify_num: int) -> None:
    """Both ASR configs made forced-aligner configs, as the two aligner releases write them."""
    original["support_languages"] = list(ALIGNER_LANGUAGES)
    original["timestamp_token_id"] = timestamp_id
    original["timestamp_segment_time"] = 80
    original["thinker_config"].update(model_type="qwen3_forced_aligner", classify_num=classify_num)
    hf.update(architectures=["Qwen3ASRForTokenClassification"], num_labels=classify_num,
              token_classification_bias=False, tie_word_embeddings=False)


def random_state_dict(cfg: ModelConfig, seed: int, std: float = 0.2, tied: bool = False) -> dict[str, torch.Tensor]:
    """Seeded random weights by module name, norm weights near one (untied: a tied head mostly repeats)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3ASRModel(cfg)
    state = {}
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and tied:
            continue  # tied to the embeddings: the loader must tie it back
        t = torch.randn(p.shape, generator=gen) * std
        if name.endswith("norm.weight") or "layer_norm.weight" in name or name.endswith("ln_post.weight"):
            t = 1.0 + t
        state[name] = t.contiguous()
    return state


def make_tiny_checkpoint(path: str | os.PathLike, layout: str = "original", seed: int = 0,
                         max_new_tokens: int = 64, extra_text: str = "", vocab_budget: int = 400,
                         shards: int = 1, dtype: torch.dtype = torch.float32, tied: bool = False,
                         std: float = 0.2, classify_num: int | None = None, **dims: int) -> Path:
    """A loadable random checkpoint; ``dims`` override TINY_DIMS; ``classify_num`` makes it an aligner."""
    if layout not in ("original", "hf"):
        raise ValueError(f"layout must be 'original' or 'hf', got {layout!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    all_dims = {**TINY_DIMS, **dims}
    specials = write_tiny_tokenizer(out, extra_text=extra_text, vocab_budget=vocab_budget)
    vocab_size = all_dims.pop("vocab_size", max(specials.values()) + 1)
    original, hf = _configs(all_dims, specials, vocab_size, tied, classify_num)
    config = original if layout == "original" else hf
    (out / "config.json").write_text(json.dumps(config, indent=2))
    eos = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    (out / "generation_config.json").write_text(json.dumps(
        dict(do_sample=False, eos_token_id=eos, pad_token_id=specials["<|endoftext|>"],
             max_new_tokens=max_new_tokens), indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(
        dict(feature_extractor_type="WhisperFeatureExtractor", feature_size=128, sampling_rate=16000,
             hop_length=160, n_fft=400, chunk_length=30, padding_value=0.0, return_attention_mask=True,
             padding_side="right", dither=0.0), indent=2))
    state = random_state_dict(ModelConfig.from_dict(original), seed, std=std, tied=tied)
    named = {_rename(k, layout, classify_num is not None): state.pop(k).to(dtype) for k in list(state)}
    _save(named, out, shards)
    return out


def make_tiny_aligner_checkpoint(path: str | os.PathLike, layout: str = "original", seed: int = 0,
                                 classify_num: int = 5000, **kwargs: object) -> Path:
    """A random forced aligner: a timestamp classifier of ``classify_num`` classes as the head."""
    return make_tiny_checkpoint(path, layout=layout, seed=seed, classify_num=classify_num,
                                **kwargs)  # type: ignore[arg-type]


def _rename(name: str, layout: str, aligner: bool = False) -> str:
    if layout == "original":
        return "thinker." + name
    if aligner and name.startswith("lm_head."):
        return "score." + name[len("lm_head."):]
    for src, dst in _HF_RENAMES:
        if name.startswith(src):
            return dst + name[len(src):]
    raise KeyError(name)


def _save(named: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    if shards <= 1:
        save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(named)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: named[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
