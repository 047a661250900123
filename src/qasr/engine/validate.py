"""Checks a request at submit: a malformed one is refused, naming what is wrong, before it reaches a batch."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from qasr.engine.request import Continuation, KVLease, RequestSpec
from qasr.model.config import EncoderConfig, audio_token_count


@dataclass(frozen=True)
class Limits:
    """What a request must agree with, read from the checkpoint."""

    audio_token_id: int
    vocab_size: int
    hop_length: int
    num_mel_bins: int
    conv_chunk_frames: int
    kv_tokens: int  # prompt + max_new_tokens must fit


def check_spec(spec: RequestSpec, limits: Limits, hidden: int, device: torch.device, prefix_grid: int) -> RequestSpec:
    """The spec with its prompt a list of ints, its audio float32 and its draft a tuple; else ValueError."""
    if not isinstance(spec, RequestSpec):
        raise TypeError(f"submit takes a RequestSpec, got {type(spec).__name__}")
    for name in ("ignore_eos", "interactive", "lead"):
        if not isinstance(getattr(spec, name), bool | np.bool_):
            raise ValueError(f"{name} must be a bool, got {getattr(spec, name)!r}")
    if not isinstance(spec.group, Hashable):
        raise ValueError(f"group must be hashable, got {type(spec.group).__name__}")
    cont = spec.continuation
    if not isinstance(cont, Continuation) or not isinstance(cont.keep_kv, bool | np.bool_):
        raise ValueError("continuation must be a Continuation (keep_kv a bool)")
    waveform, features, embeds = spec.waveform, spec.features, spec.audio_embeds
    if embeds is not None:
        if waveform is not None or features is not None:
            raise ValueError("pass audio_embeds instead of waveform or features, not with them")
        embeds = check_embeds(spec.prompt, embeds, spec.max_new_tokens, limits, hidden, device)
    else:
        waveform, features, _ = check_request(spec.prompt, waveform, features, spec.max_new_tokens, limits)
    prompt = [int(t) for t in spec.prompt]
    draft = check_draft(cont.draft, limits.vocab_size) if cont.draft else ()
    if cont.kv_prefix is not None:
        _check_prefix(cont.kv_prefix, prompt, prefix_grid)
    cont = replace(cont, draft=draft, keep_kv=bool(cont.keep_kv))
    return replace(spec, prompt=prompt, max_new_tokens=int(spec.max_new_tokens), waveform=waveform,
                   features=features, audio_embeds=embeds, ignore_eos=bool(spec.ignore_eos),
                   interactive=bool(spec.interactive), lead=bool(spec.lead), continuation=cont)


def _check_prefix(kv_prefix: tuple[KVLease, int], prompt: list[int], grid: int) -> None:
    lease, n = kv_prefix
    if not isinstance(lease, KVLease) or isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise ValueError("kv_prefix must be (a KVLease, a prompt length)")
    if not (0 < n < len(prompt) and n <= lease.valid and n % grid == 0):
        raise ValueError(f"kv_prefix length {n} must be a positive multiple of {grid} (prefix_grid), "
                         f"below the prompt's length and within the lease")
    if tuple(prompt[:n]) != lease.prompt[:n]:
        raise ValueError("kv_prefix: the prompt does not start with the kept request's tokens")


def check_request(prompt: list[int], waveform: np.ndarray | None, features: torch.Tensor | None,
                  max_new_tokens: int, limits: Limits,
                  min_new_tokens: int = 1) -> tuple[np.ndarray | None, torch.Tensor | None, int]:
    """(waveform as float32, features as float32, audio placeholders) of a valid request; else ValueError.
    ``min_new_tokens`` is 0 for alignment requests."""
    if (waveform is None) == (features is None):
        raise ValueError("pass exactly one of waveform or features")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < min_new_tokens):
        raise ValueError(f"max_new_tokens must be an integer >= {min_new_tokens}, got {max_new_tokens!r}")
    placeholders = _audio_placeholders(prompt, limits)
    if waveform is not None:
        waveform = _check_waveform(waveform, limits.hop_length)
        frames = len(waveform) // limits.hop_length
    else:
        features = _check_features(features, limits.num_mel_bins)
        frames = features.shape[-1]
    expected = audio_token_count(frames, limits.conv_chunk_frames)
    if placeholders != expected:
        raise ValueError(f"prompt has {placeholders} audio placeholders but the audio gives {expected} encoder "
                         f"tokens ({frames} frames); build the prompt for this audio (Core.prepare does)")
    need = len(prompt) + int(max_new_tokens)
    if need > limits.kv_tokens:
        raise ValueError(f"request needs {need} KV-cache tokens (prompt {len(prompt)} + max_new_tokens "
                         f"{max_new_tokens}) but the cache holds {limits.kv_tokens}; raise kv_cache_bytes or "
                         f"send shorter audio / a lower max_new_tokens")
    return waveform, features, placeholders


def check_embeds(prompt: list[int], embeds: torch.Tensor, max_new_tokens: int, limits: Limits, hidden: int,
                 device: torch.device) -> torch.Tensor:
    """Given encoder rows: one per audio placeholder, the decoder's width, finite, on the model's device."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[1] != hidden:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise ValueError(f"audio_embeds must be an (audio tokens, {hidden}) tensor, got {shape}")
    if embeds.device != device or not finite_or_deferred(embeds):
        raise ValueError(f"audio_embeds must be finite and on the model's device ({device})")
    placeholders = _audio_placeholders(prompt, limits)
    if placeholders != embeds.shape[0] or placeholders == 0:
        raise ValueError(f"prompt has {placeholders} audio placeholders but audio_embeds has {embeds.shape[0]} rows")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    need = len(prompt) + int(max_new_tokens)
    if need > limits.kv_tokens:
        raise ValueError(f"request needs {need} KV-cache tokens but the cache holds {limits.kv_tokens}")
    return embeds


def finite_or_deferred(t: torch.Tensor) -> bool:
    """Whether a CPU tensor holds no NaN or infinity; True for a tensor on another device, unread (the answer
    would wait for the device's queued work): the CUDA runner checks the audio rows a step reads, and a conv
    head through the rows it gives."""
    return t.device.type != "cpu" or bool(torch.isfinite(t).all())


def check_draft(draft: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Guessed output ids (Continuation.draft) as a tuple of token ids."""
    ids = tuple(draft)
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
        raise ValueError("draft must be a sequence of token ids")
    if not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"draft has token ids outside [0, {vocab_size})")
    return tuple(int(t) for t in ids)


def check_positions(positions: object, prompt_len: int) -> np.ndarray:
    """An alignment request's positions: distinct prompt indices, sorted (int64)."""
    pos = np.asarray(positions)
    if pos.ndim != 1 or pos.size == 0 or not np.issubdtype(pos.dtype, np.integer):
        raise ValueError("positions must be a non-empty list of prompt indices")
    pos = np.sort(pos.astype(np.int64))
    if pos[0] < 0 or pos[-1] >= prompt_len:
        raise ValueError(f"positions must lie in [0, {prompt_len}) (the prompt's length)")
    if (np.diff(pos) == 0).any():
        raise ValueError("positions must be distinct")
    return pos


def _check_waveform(waveform: np.ndarray, hop: int) -> np.ndarray:
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().numpy()
    wave = np.asarray(waveform)
    if wave.ndim != 1:
        raise ValueError(f"waveform must be 1-D mono samples, got shape {wave.shape}")
    if not np.issubdtype(wave.dtype, np.floating):
        raise ValueError(f"waveform must hold float samples in [-1, 1], got {wave.dtype}")
    if len(wave) < hop:
        raise ValueError(f"waveform too short: {len(wave)} samples, need at least one hop ({hop})")
    wave = np.ascontiguousarray(wave, dtype=np.float32)
    if not np.isfinite(wave).all():
        raise ValueError("waveform has NaN or infinite samples")
    return wave


def check_encoder_features(features: torch.Tensor, limits: Limits) -> tuple[torch.Tensor, int]:
    """An encoder-only request's features as float32, and the encoder rows they give."""
    features = _check_features(features, limits.num_mel_bins)
    return features, audio_token_count(features.shape[-1], limits.conv_chunk_frames)


def check_conv_head(conv_head: torch.Tensor, frames: int, enc: EncoderConfig, device: torch.device) -> int:
    """The rows of an encoder-only request with a conv head (chunks, tokens_per_conv_chunk, d_model) before
    ``frames`` more frames, all in one attention window."""
    want = (enc.tokens_per_conv_chunk, enc.d_model)
    if (not isinstance(conv_head, torch.Tensor) or conv_head.dim() != 3 or tuple(conv_head.shape[1:]) != want
            or conv_head.shape[0] < 1 or not conv_head.is_floating_point()):
        shape = tuple(conv_head.shape) if isinstance(conv_head, torch.Tensor) else type(conv_head).__name__
        raise ValueError(f"conv_head must be a (chunks >= 1, {want[0]}, {want[1]}) float tensor, got {shape}")
    if conv_head.device != device or not finite_or_deferred(conv_head):
        raise ValueError(f"conv_head must be finite and on the model's device ({device})")
    rows = conv_head.shape[0] * enc.tokens_per_conv_chunk + audio_token_count(frames, enc.conv_chunk_frames)
    if rows > enc.window_tokens:
        raise ValueError(f"a request with a conv head must fit one attention window ({enc.window_tokens} rows), "
                         f"it has {rows}")
    return rows


def _check_features(features: torch.Tensor, mel: int) -> torch.Tensor:
    if not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[0] != mel:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"features must be a ({mel}, frames) tensor, got {shape}")
    if features.shape[1] < 1:
        raise ValueError("features have no frames")
    if not features.is_floating_point() or not torch.isfinite(features).all():
        raise ValueError("features must be finite floats")
    return features.float()


def _audio_placeholders(prompt: list[int], limits: Limits) -> int:
    """Audio placeholders in a prompt of in-vocabulary token ids."""
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("prompt must be a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= limits.vocab_size:
        raise ValueError(f"prompt has token ids outside [0, {limits.vocab_size})")
    return int((ids == limits.audio_token_id).sum())
