"""Pushed PCM as float32, and the turn's sample buffer."""

from __future__ import annotations

import numpy as np


def as_float_pcm(pcm: np.ndarray) -> np.ndarray:
    """1-D float32 or int16 samples -> float32 (int16 scaled by 1/32768, as the official session does)."""
    x = np.asarray(pcm)
    if x.ndim != 1:
        raise ValueError(f"push mono 1-D samples, got shape {x.shape}")
    if x.dtype == np.int16:
        return x.astype(np.float32) / 32768.0
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"push float32 or int16 samples, got {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise ValueError("pushed audio has NaN or infinite samples")
    return x


class SampleBuffer:
    """A turn's samples in one float32 array, reused across turns (``reset``); it doubles when full."""

    def __init__(self, capacity: int = 16000 * 30) -> None:
        self._data = np.zeros(max(capacity, 1), dtype=np.float32)
        self.size = 0

    def append(self, samples: np.ndarray) -> None:
        need = self.size + len(samples)
        if need > len(self._data):
            grown = np.zeros(max(need, 2 * len(self._data)), dtype=np.float32)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size:need] = samples
        self.size = need

    def reset(self) -> None:
        """Empty it, keeping the allocation (earlier views become invalid)."""
        self.size = 0

    @property
    def capacity(self) -> int:
        return len(self._data)

    def view(self, end: int | None = None) -> np.ndarray:
        """Samples [0, end), without a copy: valid until the next append."""
        return self._data[: self.size if end is None else end]
