"""Test and benchmark helpers: tiny checkpoints, synthetic speech."""

from qasr.testing.checkpoint import (
    QWEN3_ASR_0_6B_DIMS,
    TINY_DIMS,
    make_tiny_aligner_checkpoint,
    make_tiny_checkpoint,
)

__all__ = ["QWEN3_ASR_0_6B_DIMS", "TINY_DIMS", "make_tiny_aligner_checkpoint", "make_tiny_checkpoint"]
