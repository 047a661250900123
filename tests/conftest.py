"""Shared fixtures: tiny random checkpoints in both layouts (same seed -> same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qasr.testing import make_tiny_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_original(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_original"), layout="original", seed=0)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_asr(tiny_original):
    from qasr import ASR

    return ASR.from_pretrained(tiny_original, device="cpu", dtype="float32")


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    """Band-limited-ish noise with a slow envelope, so features vary over time."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    env = 0.05 + 0.1 * np.abs(np.sin(np.arange(n) / 16000 * 2.3))
    return (env * rng.standard_normal(n)).astype(np.float32)
