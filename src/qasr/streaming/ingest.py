"""Wire PCM (little-endian int16 or float32, any rate, frames of any size) -> float32 at 16 kHz, the same
however the bytes were split."""

from __future__ import annotations

from typing import Literal

import numpy as np
import soxr

from qasr.audio.io import SAMPLE_RATE

PcmFormat = Literal["pcm16", "float32"]
_DTYPES = {"pcm16": np.dtype("<i2"), "float32": np.dtype("<f4")}


class PcmIngest:
    def __init__(self, pcm_format: PcmFormat = "pcm16", sample_rate: int = SAMPLE_RATE) -> None:
        if pcm_format not in _DTYPES:
            raise ValueError(f"audio format must be one of {sorted(_DTYPES)}, got {pcm_format!r}")
        if not 4000 <= sample_rate <= 192000:
            raise ValueError(f"sample rate must be between 4000 and 192000 Hz, got {sample_rate}")
        self.format = pcm_format
        self.sample_rate = sample_rate
        self._dtype = _DTYPES[pcm_format]
        self._carry = b""  # a sample split across two frames
        self._resampler = (None if sample_rate == SAMPLE_RATE
                           else soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32"))
        self.samples_in = 0  # at the wire rate

    def feed(self, data: bytes) -> np.ndarray:
        """Bytes of PCM -> float32 samples at 16 kHz (maybe none yet: the resampler holds a few ms)."""
        data = self._carry + bytes(data)
        whole = len(data) // self._dtype.itemsize * self._dtype.itemsize
        self._carry = data[whole:]
        raw = np.frombuffer(data[:whole], dtype=self._dtype)
        self.samples_in += raw.size
        return self._to_16k(self._scale(raw), last=False)

    def feed_samples(self, samples: np.ndarray) -> np.ndarray:
        """Decoded samples (int16 or float) at the wire rate -> float32 at 16 kHz."""
        x = np.asarray(samples).reshape(-1)
        self.samples_in += x.size
        return self._to_16k(self._scale(x), last=False)

    def flush(self) -> np.ndarray:
        """What the resampler still holds, at the end of the stream."""
        self._carry = b""
        return self._to_16k(np.zeros(0, dtype=np.float32), last=True)

    @staticmethod
    def _scale(x: np.ndarray) -> np.ndarray:
        if x.dtype == np.int16 or x.dtype == np.dtype("<i2"):
            return x.astype(np.float32) / 32768.0
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise ValueError("the audio has NaN or infinite samples")
        return x

    def _to_16k(self, x: np.ndarray, last: bool) -> np.ndarray:
        if self._resampler is None:
            return x
        return self._resampler.resample_chunk(x, last=last)
