"""Argument types shared by the command lines: each refuses a bad value with a message argparse prints."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from qasr.engine.config import KV_CACHE_DTYPES, QUANTIZE_CHOICES  # plain data, no torch

if TYPE_CHECKING:
    from qasr.engine_process.child import EngineSpec
    from qasr.transcribe.asr import ASR

QUANTIZE_HELP = ("int8: int8 weights and per-row int8 activations in the model's linears and encoder convolutions; "
                 "int4: the same with int4 weights (groups of 128) in the decoder's linears and LM head "
                 "(CPU only; an --aligner is not quantized; docs/quantization.md); none (default): the --dtype "
                 "weights")

# --kv-cache-dtype of transcribe, serve and bench
KV_CACHE_HELP = ("int8: keys and values stored as int8 with a scale per token and head: about half the KV memory "
                 "(twice the tokens held at once) and half the cache reads of a decode step, for a small accuracy "
                 "cost (CPU only; docs/engine.md); auto (default): the model's dtype")

# --threads of transcribe and serve
THREADS_HELP = ("CPU threads of the engine (default: torch's count, at most the CPUs this process may use: its "
                "affinity and cgroup CPU quota); on a shared host, fewer threads keep each call's time steady")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say how the model runs, shared by qasr transcribe and qasr serve."""
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    parser.add_argument("--quantize", default="none", choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_HELP)
    parser.add_argument("--max-running", type=positive_int, default=64,
                        help="sequences decoded together by the engine (default 64)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def load_asr(args: argparse.Namespace, aligner: str | None) -> ASR:
    """``ASR.from_pretrained`` with the model and the engine flags of ``add_engine_flags``."""
    from qasr.engine.engine import EngineConfig
    from qasr.transcribe.asr import ASR

    return ASR.from_pretrained(args.model, device=args.device, dtype=args.dtype, aligner=aligner,
                               quantize=args.quantize, threads=args.threads,
                               engine=EngineConfig(max_running=args.max_running, kv_cache_dtype=args.kv_cache_dtype))


def engine_spec(args: argparse.Namespace, aligner: str | None) -> EngineSpec:
    """What ``load_asr`` would load, for an engine process (qasr serve)."""
    import logging

    from qasr.engine.config import EngineConfig, quantize_option
    from qasr.engine_process.child import EngineSpec

    engine = EngineConfig(max_running=args.max_running, kv_cache_dtype=args.kv_cache_dtype,
                          quantize=quantize_option(args.quantize), threads=args.threads)
    return EngineSpec(args.model, device=args.device, dtype=args.dtype, engine=engine, aligner=aligner,
                      aligner_engine=EngineConfig(threads=args.threads),
                      log_level=logging.getLevelName(args.log_level.upper()))
