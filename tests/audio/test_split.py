"""Tests for qasr.audio.split: cut placement, exact tiling, offsets and tail padding."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.audio.split import AudioPiece, split_long_audio

SR = 16000


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-0.5, 0.5, size=int(seconds * SR)).astype(np.float32)


def _check_tiling(x: np.ndarray, pieces: list[AudioPiece]) -> None:
    """Pieces must be contiguous, start at their offsets and rebuild ``x`` exactly."""
    position = 0
    for piece in pieces:
        assert piece.offset_sec == position / SR
        position += len(piece.samples)
    assert position == len(x)
    np.testing.assert_array_equal(np.concatenate([p.samples for p in pieces]), x)


def test_short_audio_is_one_unpadded_piece() -> None:
    x = _noise(0.2)
    pieces = split_long_audio(x, max_chunk_sec=20)
    assert len(pieces) == 1
    assert pieces[0].offset_sec == 0.0
    assert pieces[0].samples is x
    exactly_max = _noise(20.0)
    assert len(split_long_audio(exactly_max, max_chunk_sec=20)) == 1


def test_cuts_land_in_silent_gaps() -> None:
    x = _noise(50.0)
    gaps = [(int(19.4 * SR), int(19.7 * SR)), (int(40.1 * SR), int(40.4 * SR))]
    for lo, hi in gaps:
        x[lo:hi] = 0.0
    pieces = split_long_audio(x, max_chunk_sec=20)
    assert len(pieces) == 3
    _check_tiling(x, pieces)
    boundaries = [round(p.offset_sec * SR) for p in pieces[1:]]
    for boundary, (lo, hi) in zip(boundaries, gaps, strict=True):
        assert lo <= boundary < hi
    # The quietest window is the first all-zero one, and its first zero is the cut.
    assert boundaries[0] == gaps[0][0]
    assert pieces[1].offset_sec == pytest.approx(19.4)


def test_cut_matches_brute_force_energy_search() -> None:
    # Modulated noise gives a unique quietest 100 ms window inside the +-5 s search range.
    x = _noise(30.0, seed=3)
    t = np.arange(len(x)) / SR
    x *= (0.2 + np.abs(t - 21.3)).astype(np.float32)
    pieces = split_long_audio(x, max_chunk_sec=20)
    _check_tiling(x, pieces)
    lo, hi = 15 * SR, 25 * SR
    mag = np.abs(x[lo:hi]).astype(np.float64)
    sums = np.array([mag[i : i + 1600].sum() for i in range(0, len(mag) - 1600 + 1)])
    best = int(np.argmin(sums))
    expected = lo + best + int(np.argmin(mag[best : best + 1600]))
    assert round(pieces[1].offset_sec * SR) == expected


def test_short_tail_is_zero_padded() -> None:
    x = _noise(10.3)
    gap = int(9.9 * SR)
    x[gap : gap + int(0.15 * SR)] = 0.0  # longer than the 100 ms energy window
    pieces = split_long_audio(x, max_chunk_sec=10)
    assert len(pieces) == 2
    head, tail = pieces
    assert tail.offset_sec == pytest.approx(9.9)
    assert len(head.samples) == gap
    assert len(tail.samples) == int(0.5 * SR)
    rest = x[gap:]
    np.testing.assert_array_equal(tail.samples[: len(rest)], rest)
    assert not tail.samples[len(rest) :].any()


def test_no_search_window_cuts_at_max_length() -> None:
    x = _noise(25.0)
    pieces = split_long_audio(x, max_chunk_sec=10, search_sec=0.0)
    assert [len(p.samples) for p in pieces] == [10 * SR, 10 * SR, 5 * SR]
    _check_tiling(x, pieces)


def test_pieces_are_frozen_and_input_checked() -> None:
    piece = split_long_audio(_noise(1.0))[0]
    with pytest.raises(AttributeError):
        piece.offset_sec = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="1-D"):
        split_long_audio(np.zeros((2, 100), dtype=np.float32))
