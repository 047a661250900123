"""Pieces of the side-by-side benchmark that decide what it measures."""

from __future__ import annotations

import os

import numpy as np
import pytest

from qasr.bench import PeakRss, clip_lengths


def test_clip_lengths_are_seeded_and_spread_over_2_to_120_s() -> None:
    a, b = clip_lengths(16, seed=0), clip_lengths(16, seed=0)
    assert a == b and a != clip_lengths(16, seed=1)
    assert all(2.0 <= x <= 120.0 for x in a)
    s = sorted(a)
    assert s[0] < 3.0 and s[-1] > 90.0  # stratified: both ends of the range are present


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_sees_a_short_lived_allocation() -> None:
    with PeakRss() as quiet:
        pass
    with PeakRss() as busy:
        block = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
        del block
    assert busy.peak - quiet.peak > 150 * 2**20
