"""Log-mel features as ``WhisperFeatureExtractor`` makes them for one utterance: N samples give ``N // hop``
frames, clamped 8 decades below the utterance's own maximum (independent of the batch)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FeatureConfig:
    """From preprocessor_config.json."""

    num_mel_bins: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400

    @classmethod
    def from_dict(cls, d: dict) -> FeatureConfig:
        return cls(
            num_mel_bins=int(d.get("feature_size", 128)),
            sampling_rate=int(d.get("sampling_rate", 16000)),
            hop_length=int(d.get("hop_length", 160)),
            n_fft=int(d.get("n_fft", 400)),
        )


# Slaney's Auditory Toolbox mel scale: linear below 1 kHz, logarithmic above
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    above = hz >= _MIN_LOG_HZ
    mel[above] = _MIN_LOG_MEL + np.log(hz[above] / _MIN_LOG_HZ) / _LOGSTEP
    return mel


def _mel_to_hz_slaney(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * _F_SP
    above = mel >= _MIN_LOG_MEL
    hz[above] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel[above] - _MIN_LOG_MEL))
    return hz


@functools.lru_cache(maxsize=8)
def mel_filterbank(num_mel_bins: int, n_fft: int, sampling_rate: int) -> np.ndarray:
    """Slaney-scale, slaney-normalised triangular filters, shape (n_fft // 2 + 1, num_mel_bins)."""
    n_freqs = n_fft // 2 + 1
    fft_freqs = np.linspace(0, sampling_rate // 2, n_freqs)
    mel_points = np.linspace(_hz_to_mel_slaney(np.array([0.0]))[0],
                             _hz_to_mel_slaney(np.array([sampling_rate / 2]))[0], num_mel_bins + 2)
    hz_points = _mel_to_hz_slaney(mel_points)
    widths = np.diff(hz_points)
    slopes = hz_points[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (hz_points[2:num_mel_bins + 2] - hz_points[:num_mel_bins])
    return filters * enorm[None, :]


MIN_MEL_COLUMNS = 32  # frames every mel product computes at least (see log10_mel)


def log10_mel(filters: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """log10 of the mel energies of power frames (freqs, n), before the clamp. Padded to MIN_MEL_COLUMNS:
    BLAS takes other kernels for few columns, and a frame must not depend on how many came with it."""
    n = power.shape[1]
    if n < MIN_MEL_COLUMNS:
        power = torch.nn.functional.pad(power, (0, MIN_MEL_COLUMNS - n))
    mel = (filters @ power)[:, :n]
    return torch.clamp(mel, min=1e-10).log10()


class LogMel:

    def __init__(self, config: FeatureConfig = FeatureConfig(), device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._window = torch.hann_window(config.n_fft, device=self.device)
        fb = mel_filterbank(config.num_mel_bins, config.n_fft, config.sampling_rate)
        self._filters = torch.from_numpy(fb.T.astype(np.float32)).to(self.device)  # (mels, freqs)

    def num_frames(self, num_samples: int) -> int:
        return num_samples // self.config.hop_length

    def __call__(self, waveform: np.ndarray | torch.Tensor) -> torch.Tensor:
        """One utterance (N,) float32 -> (num_mel_bins, N // hop) float32."""
        x = torch.as_tensor(waveform, dtype=torch.float32, device=self.device)
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D waveform, got shape {tuple(x.shape)}")
        cfg = self.config
        if x.numel() < cfg.hop_length:
            raise ValueError(f"audio too short for one feature frame ({x.numel()} samples)")
        # reflect padding needs n_fft // 2 + 1 samples: zeros first, frames still N // hop
        frames = self.num_frames(x.numel())
        if x.numel() <= cfg.n_fft // 2:
            x = torch.nn.functional.pad(x, (0, cfg.n_fft // 2 + 1 - x.numel()))
        spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=self._window, return_complex=True)
        log_spec = log10_mel(self._filters, spec[:, :frames].abs() ** 2)
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0
