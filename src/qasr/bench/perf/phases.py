"""Achieved FLOP/s and bytes/s of the engine's phases against the machine's measured peaks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from qasr.bench.perf.flops import (
    PhaseFlops,
    Utterance,
    decode_row_flops,
    decoder_weight_bytes,
    encoder_weight_bytes,
    kv_bytes_per_position,
)
from qasr.engine.cpu.int4 import GROUP as INT4_GROUP
from qasr.model.config import ModelConfig, audio_token_count

PHASES = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class Storage:
    """Bytes per weight and per cached key or value element, as the mode stores them."""

    encoder_weight: float = 2.0
    decoder_weight: float = 2.0  # the decoder's linears and the LM head
    kv_value: float = 2.0  # its scale's share included
    quantized: bool = False  # int8 products: the roof is the int8 peak
    activation: float = 2.0  # per element of the encoder's output

    @classmethod
    def of(cls, itemsize: int, quantize: str | None = None, kv_cache_dtype: str = "auto",
           head_dim: int = 128) -> Storage:
        """``quantize``: None, "int8" or "int4"; ``kv_cache_dtype``: "auto" or "int8"."""
        kv = 1.0 + 4.0 / head_dim if kv_cache_dtype == "int8" else float(itemsize)
        if quantize is None:
            return cls(float(itemsize), float(itemsize), kv, activation=float(itemsize))
        return cls(1.0, 0.5 + 4.0 / INT4_GROUP if quantize == "int4" else 1.0, kv, quantized=True,
                   activation=float(itemsize))


@dataclass
class ForwardLog:
    """Counts of what the engine's encoder calls and decoder forwards carried."""

    encoder_calls: int = 0
    mixed_forwards: int = 0  # forwards carrying prefill chunks
    decode_forwards: int = 0
    prefill_tokens: int = 0
    prefill_kv_read: int = 0  # a chunk [a, b) reads b positions
    ride_rows: int = 0  # decode rows inside mixed forwards
    ride_attended: int = 0
    decode_rows: int = 0
    decode_attended: int = 0

    def attach(self, runner: Any) -> None:
        """Count every later ``runner.encode`` / ``runner.forward`` call."""
        encode, forward = runner.encode, runner.forward

        def counted_encode(*args: Any, **kwargs: Any) -> Any:
            self.encoder_calls += 1
            return encode(*args, **kwargs)

        def counted_forward(plan: Any, *args: Any, **kwargs: Any) -> Any:
            self.note(plan)
            return forward(plan, *args, **kwargs)

        runner.encode, runner.forward = counted_encode, counted_forward

    def note(self, plan: Any) -> None:
        attended = sum(len(r.prompt) + len(r.output) for r in plan.decode)
        if not plan.prefill:
            self.decode_forwards += 1
            self.decode_rows += len(plan.decode)
            self.decode_attended += attended
            return
        self.mixed_forwards += 1
        self.ride_rows += len(plan.decode)
        self.ride_attended += attended
        reached: dict[int, int] = {}
        for req, n in plan.prefill:
            end = reached[id(req)] = reached.get(id(req), req.prefilled) + n
            self.prefill_tokens += n
            self.prefill_kv_read += end


def _phase(flop: float, seconds: float, nbytes: float, peak: float, bandwidth: float) -> dict:
    s = max(seconds, 1e-12)
    return dict(seconds=seconds, flop=flop, bytes=nbytes, flops=flop / s, intensity=flop / max(nbytes, 1.0),
                efficiency=flop / s / peak, bandwidth_Bps=nbytes / s, bandwidth_fraction=nbytes / s / bandwidth)


def phase_report(cfg: ModelConfig, utterances: Sequence[Utterance], flops: PhaseFlops, timings: dict,
                 log: ForwardLog, peak_flops: float, bandwidth_Bps: float, storage: Storage | None = None) -> dict:
    """Per phase: seconds, FLOP, minimum bytes moved, FLOP/s and bytes/s, and their fractions of the peaks."""
    st = storage or Storage()
    enc, dec = cfg.encoder, cfg.decoder
    ride = decode_row_flops(dec, log.ride_rows, log.ride_attended)
    share = flops.prefill / (flops.prefill + ride) if flops.prefill + ride > 0 else 1.0
    weights = decoder_weight_bytes(dec, st.decoder_weight)
    kv = kv_bytes_per_position(dec, st.kv_value)
    # its weights once per call, float32 features in, embeddings out
    enc_bytes = (encoder_weight_bytes(enc, st.encoder_weight) * log.encoder_calls
                 + sum(u.frames for u in utterances) * enc.num_mel_bins * 4
                 + sum(audio_token_count(u.frames, enc.conv_chunk_frames) for u in utterances)
                 * enc.output_dim * st.activation)
    pre_bytes = weights * log.mixed_forwards * share + kv * (log.prefill_kv_read + log.prefill_tokens)
    dec_bytes = (weights * (log.decode_forwards + log.mixed_forwards * (1 - share))
                 + kv * (log.decode_attended + log.ride_attended))
    mixed_s = timings["forward_mixed_s"]
    seconds = dict(encoder=timings["encoder_s"] - timings["features_s"], prefill=mixed_s * share,
                   decode=timings["forward_decode_s"] + mixed_s * (1 - share))
    nbytes = dict(encoder=enc_bytes, prefill=pre_bytes, decode=dec_bytes)
    phases = {p: _phase(getattr(flops, p), seconds[p], nbytes[p], peak_flops, bandwidth_Bps) for p in PHASES}
    return dict(phases=phases, mixed_prefill_share=share, forwards=asdict(log),
                split_rule="mixed forwards' seconds and weight traffic split between prefill chunks and "
                           "ride-along decode rows in proportion to FLOP; KV reads charged to their rows")


def efficiency_report(cfg: ModelConfig, utterances: Sequence[Utterance], flops: PhaseFlops, audio_s: float,
                      wall_s: float, timings: dict, log: ForwardLog, machine: dict,
                      reference_wall_s: float | None = None, storage: Storage | None = None) -> dict:
    """Model FLOP / wall seconds / peak GEMM rate, overall and per phase."""
    peak, bw = machine["peak_flops"], machine["bandwidth_Bps"]
    out: dict[str, Any] = dict(
        peak_flops=peak, bandwidth_Bps=bw, flop_per_audio_s={p: getattr(flops, p) / audio_s for p in PHASES},
        overall=flops.total / wall_s / peak)
    out["flop_per_audio_s"]["total"] = flops.total / audio_s
    if reference_wall_s:
        out["reference_overall"] = flops.total / reference_wall_s / peak
    out.update(phase_report(cfg, utterances, flops, timings, log, peak, bw, storage))
    int8_peak = machine.get("int8_peak_ops")
    if storage is not None and storage.quantized and int8_peak:
        out["int8_peak_ops"] = int8_peak
        out["int8_overall"] = flops.total / wall_s / int8_peak
        for v in out["phases"].values():
            v["int8_efficiency"] = v["flops"] / int8_peak
    return out


def timing_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}

