"""The official long-audio cuts, each at the quietest point near its nominal place."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ENERGY_WINDOW_SEC = 0.1
_MIN_ENERGY_WINDOW = 4


@dataclass(frozen=True)
class AudioPiece:
    """A view of the input (zero-padded when short); ``offset_sec``: where it starts in the input."""

    samples: np.ndarray
    offset_sec: float


def split_long_audio(
    x: np.ndarray,
    max_chunk_sec: float = 1200.0,
    sample_rate: int = 16000,
    search_sec: float = 5.0,
    min_piece_sec: float = 0.5,
) -> list[AudioPiece]:
    """Pieces tiling ``x``, each cut within ``search_sec`` of ``start + max_chunk_sec`` at the quietest point;
    pieces under ``min_piece_sec`` zero-padded (the model refuses shorter inputs)."""
    if x.ndim != 1:
        raise ValueError(f"split_long_audio expects a 1-D waveform, got shape {x.shape}")
    if sample_rate <= 0 or max_chunk_sec <= 0 or search_sec < 0:
        raise ValueError("sample_rate and max_chunk_sec must be positive and search_sec non-negative")
    total = x.shape[0]
    if total / sample_rate <= max_chunk_sec:
        return [AudioPiece(samples=x, offset_sec=0.0)]

    max_len = int(max_chunk_sec * sample_rate)
    reach = int(search_sec * sample_rate)
    win = max(_MIN_ENERGY_WINDOW, int(_ENERGY_WINDOW_SEC * sample_rate))
    min_len = int(min_piece_sec * sample_rate)

    bounds = [0]
    start = 0
    while total - start > max_len:
        cut = start + max_len
        boundary = _quiet_boundary(x, cut, max(start, cut - reach), min(total, cut + reach), win)
        start = min(max(boundary, start + 1), total)
        bounds.append(start)
    bounds.append(total)

    return [
        AudioPiece(samples=_pad_to(x[lo:hi], min_len), offset_sec=lo / sample_rate)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def _quiet_boundary(x: np.ndarray, cut: int, lo: int, hi: int, win: int) -> int:
    """The quietest sample of the quietest ``win`` samples of ``x[lo:hi]`` (``cut`` when only one window fits).
    float32 ``np.convolve`` as the reference, so ties resolve the same."""
    if hi - lo <= win:
        return cut
    mag = np.abs(x[lo:hi]).astype(np.float32, copy=False)
    energy = np.convolve(mag, np.ones(win, dtype=np.float32), mode="valid")
    best = int(np.argmin(energy))
    return lo + best + int(np.argmin(mag[best : best + win]))


def _pad_to(piece: np.ndarray, min_len: int) -> np.ndarray:
    if piece.shape[0] >= min_len:
        return piece
    return np.pad(piece, (0, min_len - piece.shape[0]))
