"""Model FLOP and minimum memory traffic of a Qwen3-ASR workload, counted from the checkpoint config.

FLOP = twice the multiply-accumulates of the matrix products (norms, activations, softmax, rotary are
left out), as the model defines the work: whole 1 s conv chunks, attention within the true windows,
causal decoder attention, lm_head only on the rows whose logits are used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from qasr.model.config import DecoderConfig, EncoderConfig, ModelConfig, audio_token_count


@dataclass(frozen=True)
class Utterance:
    frames: int  # mel frames of the clip (samples // hop)
    prompt_tokens: int  # the whole prompt, audio placeholders included
    new_tokens: int  # generated tokens (forced: EOS ignored)


@dataclass(frozen=True)
class PhaseFlops:
    encoder: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0

    @property
    def total(self) -> float:
        return self.encoder + self.prefill + self.decode

    def __add__(self, other: PhaseFlops) -> PhaseFlops:
        return PhaseFlops(self.encoder + other.encoder, self.prefill + other.prefill, self.decode + other.decode)

    def scaled(self, k: float) -> PhaseFlops:
        return PhaseFlops(self.encoder * k, self.prefill * k, self.decode * k)


def _half(n: int) -> int:
    """Output length of a kernel-3, stride-2, padding-1 convolution."""
    return (n - 1) // 2 + 1


# --- encoder
def conv_stack_macs(enc: EncoderConfig) -> int:
    """MACs of one chunk (mel x conv_chunk_frames) through conv2d1..3 and conv_out."""
    ch, f, t = enc.downsample_hidden_size, enc.num_mel_bins, enc.conv_chunk_frames
    macs = 0
    cin = 1
    for _ in range(3):
        f, t = _half(f), _half(t)
        macs += ch * cin * 9 * f * t
        cin = ch
    return macs + t * (ch * f) * enc.d_model  # conv_out: every position of the chunk, (ch * freq) -> d


def encoder_layer_macs_per_token(enc: EncoderConfig) -> int:
    d = enc.d_model
    return 4 * d * d + 2 * d * enc.encoder_ffn_dim  # q, k, v, out; fc1, fc2


def projector_macs_per_token(enc: EncoderConfig) -> int:
    return enc.d_model * enc.d_model + enc.d_model * enc.output_dim  # proj1, proj2


def encoder_flops(enc: EncoderConfig, frames: int) -> float:
    chunks = max(1, math.ceil(frames / enc.conv_chunk_frames))
    tokens = audio_token_count(frames, enc.conv_chunk_frames)
    win = enc.window_tokens
    windows = [min(win, tokens - w) for w in range(0, tokens, win)]
    macs = chunks * conv_stack_macs(enc)
    macs += tokens * (enc.encoder_layers * encoder_layer_macs_per_token(enc) + projector_macs_per_token(enc))
    macs += enc.encoder_layers * sum(2 * n * n * enc.d_model for n in windows)  # scores + weighted sum
    return 2.0 * macs


def encoder_weight_bytes(enc: EncoderConfig, itemsize: int = 2) -> int:
    ch, d = enc.downsample_hidden_size, enc.d_model
    freq = _half(_half(_half(enc.num_mel_bins)))
    params = ch * 9 + 2 * ch * ch * 9 + ch * freq * d
    params += enc.encoder_layers * encoder_layer_macs_per_token(enc) + projector_macs_per_token(enc)
    return params * itemsize


# --- decoder
def decoder_layer_macs_per_token(dec: DecoderConfig) -> int:
    h, q, kv = dec.hidden_size, dec.num_attention_heads * dec.head_dim, dec.num_key_value_heads * dec.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * dec.intermediate_size  # q, k, v, o; gate, up, down


def decoder_token_macs(dec: DecoderConfig) -> int:
    """All layers' linears for one token (no lm_head, no attention)."""
    return dec.num_hidden_layers * decoder_layer_macs_per_token(dec)


def lm_head_macs(dec: DecoderConfig) -> int:
    return dec.hidden_size * dec.vocab_size


def attention_macs(dec: DecoderConfig, attended: int) -> int:
    """One query row over ``attended`` cached positions, all layers (scores + weighted sum, every q head)."""
    return dec.num_hidden_layers * 2 * dec.num_attention_heads * dec.head_dim * attended


def prefill_flops(dec: DecoderConfig, prompt_tokens: int) -> float:
    p = prompt_tokens
    macs = p * decoder_token_macs(dec) + attention_macs(dec, p * (p + 1) // 2) + lm_head_macs(dec)
    return 2.0 * macs


def decode_row_flops(dec: DecoderConfig, rows: int, attended: int) -> float:
    """``rows`` decode rows that together attend ``attended`` positions (each row: its context + itself)."""
    return 2.0 * (rows * (decoder_token_macs(dec) + lm_head_macs(dec)) + attention_macs(dec, attended))


def decode_attended(prompt_tokens: int, new_tokens: int) -> int:
    """Positions attended over the N - 1 decode rows: row j (1..N-1) sits at P + j - 1 and sees P + j."""
    steps = max(0, new_tokens - 1)
    return steps * prompt_tokens + steps * (steps + 1) // 2


def decode_flops(dec: DecoderConfig, prompt_tokens: int, new_tokens: int) -> float:
    return decode_row_flops(dec, max(0, new_tokens - 1), decode_attended(prompt_tokens, new_tokens))


def decoder_weight_bytes(dec: DecoderConfig, itemsize: int = 2) -> int:
    """What one decoder forward streams: every layer's linears and the lm_head (the embedding is a gather)."""
    return (decoder_token_macs(dec) + lm_head_macs(dec)) * itemsize


def kv_bytes_per_position(dec: DecoderConfig, itemsize: int = 2) -> int:
    return 2 * dec.num_hidden_layers * dec.num_key_value_heads * dec.head_dim * itemsize


# --- workload
def utterance_flops(cfg: ModelConfig, utt: Utterance) -> PhaseFlops:
    return PhaseFlops(encoder_flops(cfg.encoder, utt.frames), prefill_flops(cfg.decoder, utt.prompt_tokens),
                      decode_flops(cfg.decoder, utt.prompt_tokens, utt.new_tokens))


def workload_flops(cfg: ModelConfig, utterances: Iterable[Utterance]) -> PhaseFlops:
    total = PhaseFlops()
    for utt in utterances:
        total = total + utterance_flops(cfg, utt)
    return total
