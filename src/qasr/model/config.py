"""Frozen configs read from config.json in either layout: the release (``thinker_config``) or the "-hf"
conversion (``audio_config`` / ``text_config``). qasr's own settings sit in a top-level ``"qasr"`` object."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# The segment length when neither the call nor the checkpoint names one, as the official package sends.
DEFAULT_MAX_SEGMENT_S = 30.0


@dataclass(frozen=True)
class EncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    output_dim: int
    n_window: int
    n_window_infer: int
    downsample_hidden_size: int
    conv_chunksize: int = 500

    @property
    def conv_chunk_frames(self) -> int:
        """Mel frames per conv chunk."""
        return 2 * self.n_window

    @property
    def tokens_per_conv_chunk(self) -> int:
        return post_conv_length(self.conv_chunk_frames)

    @property
    def window_tokens(self) -> int:
        """Tokens per encoder attention window."""
        return self.tokens_per_conv_chunk * (self.n_window_infer // self.conv_chunk_frames)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderConfig:
        return cls(
            num_mel_bins=int(d.get("num_mel_bins", 128)),
            d_model=int(d["d_model"]),
            encoder_layers=int(d["encoder_layers"]),
            encoder_attention_heads=int(d["encoder_attention_heads"]),
            encoder_ffn_dim=int(d["encoder_ffn_dim"]),
            output_dim=int(d["output_dim"]),
            n_window=int(d.get("n_window", 50)),
            n_window_infer=int(d.get("n_window_infer", 800)),
            downsample_hidden_size=int(d.get("downsample_hidden_size", 480)),
            conv_chunksize=int(d.get("conv_chunksize", 500)),
        )


def post_conv_length(frames: int) -> int:
    """Length after the three stride-2 convolutions (k 3, p 1)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


def audio_token_count(frames: int, conv_chunk_frames: int = 100) -> int:
    """Encoder output tokens for ``frames`` mel frames."""
    full, rest = divmod(frames, conv_chunk_frames)
    return full * post_conv_length(conv_chunk_frames) + post_conv_length(rest)


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, d: dict, tie_default: bool) -> DecoderConfig:
        theta = d.get("rope_theta")
        if theta is None:
            theta = (d.get("rope_parameters") or {}).get("rope_theta")
        if theta is None:
            theta = (d.get("rope_scaling") or {}).get("rope_theta", 1_000_000.0)
        heads = int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 65536)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", tie_default)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs from config.json."""

    layout: str  # "original" | "hf"
    encoder: EncoderConfig
    decoder: DecoderConfig
    audio_token_id: int
    audio_start_token_id: int | None
    audio_end_token_id: int | None
    support_languages: tuple[str, ...] = ()
    # the forced aligner's head classes (class k = k * timestamp_segment_time ms); None for ASR models
    classify_num: int | None = None
    timestamp_token_id: int | None = None
    timestamp_segment_time: float = 80.0
    # config.json's "qasr": {"max_segment_s": S}
    declared_max_segment_s: float | None = None

    @property
    def max_segment_s(self) -> float:
        """The segment length a call gets when it names none."""
        return self.declared_max_segment_s or DEFAULT_MAX_SEGMENT_S

    @property
    def is_aligner(self) -> bool:
        return self.classify_num is not None

    @property
    def head_size(self) -> int:
        """Output rows of the head: the aligner's classes, else the vocabulary."""
        return self.classify_num if self.classify_num is not None else self.decoder.vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        if "thinker_config" in d:
            th = d["thinker_config"]
            tie = bool(d.get("tie_word_embeddings", th.get("tie_word_embeddings", True)))
            return cls._read("original", th, d, tie)
        if "audio_config" in d and "text_config" in d:
            return cls._read("hf", d, d, bool(d.get("tie_word_embeddings", True)))
        raise ValueError("config.json is neither the Qwen3-ASR release layout (thinker_config) "
                         "nor the transformers layout (audio_config + text_config)")

    @classmethod
    def _read(cls, layout: str, net: dict, top: dict, tie: bool) -> ModelConfig:
        return cls(
            layout=layout,
            encoder=EncoderConfig.from_dict(net["audio_config"]),
            decoder=DecoderConfig.from_dict(net["text_config"], tie),
            audio_token_id=int(net["audio_token_id"]),
            audio_start_token_id=_opt_int(net.get("audio_start_token_id")),
            audio_end_token_id=_opt_int(net.get("audio_end_token_id")),
            support_languages=tuple(top.get("support_languages") or ()),
            declared_max_segment_s=declared_max_segment_s(top),
            **_aligner_fields(top),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except ValueError as exc:  # json's too: say which file
            raise ValueError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class GenerationDefaults:
    """Stop ids and length limit from generation_config.json, if any."""

    eos_token_ids: tuple[int, ...]
    max_new_tokens: int = 512

    @classmethod
    def load(cls, model_dir: Path, fallback_eos: tuple[int, ...]) -> GenerationDefaults:
        path = model_dir / "generation_config.json"
        if not path.exists():
            return cls(eos_token_ids=fallback_eos)
        d = json.loads(path.read_text())
        eos = d.get("eos_token_id", list(fallback_eos))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])) or fallback_eos
        return cls(eos_token_ids=eos_ids, max_new_tokens=int(d.get("max_new_tokens", 512)))


def _aligner_fields(d: dict) -> dict:
    """A forced aligner's classify_num and timestamp fields; {} for ASR. In the "-hf" layout every config
    carries ``timestamp_token_id``: the architecture decides."""
    th = d.get("thinker_config")
    if th is not None:
        if "forced_aligner" not in str(th.get("model_type", "")):
            return {}
        classes = int(th.get("classify_num", d.get("classify_num", 5000)))
    else:
        archs = d.get("architectures") or []
        if not any("TokenClassification" in str(a) for a in archs):
            return {}
        labels = d.get("num_labels") or len(d.get("id2label") or {})
        if not labels:
            raise ValueError("aligner config.json names no classes (num_labels / id2label)")
        classes = int(labels)
    ts = d.get("timestamp_token_id", (th or {}).get("timestamp_token_id"))
    if ts is None:
        raise ValueError("forced-aligner config.json has no timestamp_token_id")
    return dict(classify_num=classes, timestamp_token_id=int(ts),
                timestamp_segment_time=float(d.get("timestamp_segment_time", 80)))


def declared_max_segment_s(top: dict) -> float | None:
    """``"qasr": {"max_segment_s": S}`` (positive seconds), None when absent; ValueError (at load) otherwise."""
    own = top.get("qasr")
    if own is None:
        return None
    if not isinstance(own, dict):
        raise ValueError(f'"qasr" must be an object such as {{"max_segment_s": 12}}, got {own!r}')
    if "max_segment_s" not in own or own["max_segment_s"] is None:
        return None
    value = own["max_segment_s"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f'"qasr": {{"max_segment_s": ...}} must be a positive number of seconds, got {value!r}')
    return float(value)


def _opt_int(v: object) -> int | None:
    return None if v is None else int(v)  # type: ignore[arg-type]
