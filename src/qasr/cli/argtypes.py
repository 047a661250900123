"""Argument types shared by the command lines: each refuses a bad value with a message argparse prints."""

from __future__ import annotations

import argparse

from qasr.engine.config import QUANTIZE_CHOICES  # noqa: F401 - plain data, no torch; re-exported

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
