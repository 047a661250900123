"""The head's class ids -> word times (class k is k * segment_time ms)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qasr.results import Word


def repair_monotonic(values: Sequence[float]) -> list[int]:
    """``values`` (ms) made non-decreasing as the official aligner does, truncated to int: the longest
    non-decreasing subsequence is kept; a run of up to two others takes the nearer kept neighbour, a
    longer run is interpolated between them."""
    data = [float(v) for v in values]
    n = len(data)
    if n == 0:
        return []
    keep = _lnds_mask(np.asarray(data, dtype=np.float64))
    out = list(data)
    i = 0
    while i < n:
        if keep[i]:
            i += 1
            continue
        j = i
        while j < n and not keep[j]:
            j += 1
        left = out[i - 1] if i > 0 else None
        right = out[j] if j < n else None
        run = j - i
        for k in range(i, j):
            if left is None or right is None:
                out[k] = right if left is None else left  # type: ignore[assignment]
            elif run <= 2:
                out[k] = left if (k - (i - 1)) <= (j - k) else right
            else:
                out[k] = left + (right - left) / (run + 1) * (k - i + 1)
        i = j
    return [int(v) for v in out]


def _lnds_mask(x: np.ndarray) -> np.ndarray:
    """The longest non-decreasing subsequence as a mask, ties as in the reference DP (the first longest chain)."""
    n = len(x)
    dp = np.ones(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for cur in range(1, n):
        ok = x[:cur] <= x[cur]
        if ok.any():
            cand = np.where(ok, dp[:cur], 0)
            best = int(cand.argmax())  # first index of the maximum
            dp[cur] = cand[best] + 1
            parent[cur] = best
    keep = np.zeros(n, dtype=bool)
    idx = int(dp.argmax())
    while idx != -1:
        keep[idx] = True
        idx = int(parent[idx])
    return keep


def words_from_classes(units: Sequence[str], classes: Sequence[int], segment_ms: float) -> list[Word]:
    """Unit i spans slots 2i and 2i + 1; seconds rounded to 3 decimals."""
    if len(classes) != 2 * len(units):
        raise ValueError(f"{len(units)} units need {2 * len(units)} timestamps, got {len(classes)}")
    # float32, as the reference scales them
    ms = (np.asarray(classes, dtype=np.float32) * np.float32(segment_ms)).tolist()
    fixed = repair_monotonic(ms)
    return [Word(w, round(fixed[2 * i] / 1000.0, 3), round(fixed[2 * i + 1] / 1000.0, 3))
            for i, w in enumerate(units)]
