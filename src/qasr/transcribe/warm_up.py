"""The warm-up: one short transcription before the first caller's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qasr.transcribe.asr import ASR


def warm_up(asr: ASR) -> None:
    """Transcribe a second of quiet noise (word timestamps when ``asr`` has an aligner), so that lazy set-up
    (kernels, the allocator's pools) is paid now rather than by the first caller."""
    noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.01
    asr.transcribe((noise, 16000), timestamps="word" if asr._core.aligner is not None else "segment")
