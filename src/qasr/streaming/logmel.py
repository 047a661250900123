"""Log-mel of a growing stream, bit-identical to ``audio.features.LogMel`` on all the audio so far: final frames
(their window inside the audio) are stored, and the clamp ``max(x, max - 8)`` applied when features are read.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from qasr.audio.features import FeatureConfig, log10_mel, mel_filterbank


class StreamingLogMel:
    def __init__(self, config: FeatureConfig | None = None, capacity_frames: int = 3000) -> None:
        self.config = config = config or FeatureConfig()
        self._window = torch.hann_window(config.n_fft)
        fb = mel_filterbank(config.num_mel_bins, config.n_fft, config.sampling_rate)
        self._filters = torch.from_numpy(fb.T.astype(np.float32))
        self._raw = torch.empty(config.num_mel_bins, capacity_frames)
        self.final = 0  # frames [0, final) are stored
        self._final_max = torch.tensor(float("-inf"))
        self._open = torch.empty(config.num_mel_bins, 0)  # frames [final, frames)
        self.frames = 0
        self.floor = torch.tensor(float("-inf"))  # max - 8

    def advance(self, samples: np.ndarray) -> int:
        """Catch up with ``samples`` (the whole stream so far); returns the frames computed."""
        cfg = self.config
        n = len(samples)
        frames = n // cfg.hop_length
        a = self.final
        raw = self._compute(samples, a, frames)
        half = cfg.n_fft // 2
        final = max(a, min(frames, (n - half - 1) // cfg.hop_length + 1))  # frames t with t*hop + half < n
        self._store(raw[:, : final - a])
        self._open = raw[:, final - a:]
        self.frames = frames
        top = self._final_max if self._open.shape[1] == 0 else torch.maximum(self._final_max, self._open.max())
        self.floor = top - 8.0
        return frames - a

    def _compute(self, samples: np.ndarray, a: int, frames: int) -> torch.Tensor:
        """Raw log10 mel of frames [a, frames)."""
        cfg = self.config
        half = cfg.n_fft // 2
        if frames <= a:
            return torch.empty(cfg.num_mel_bins, 0)
        if a * cfg.hop_length < half:  # the start's reflect padding: as LogMel
            x = torch.from_numpy(samples)
            if x.numel() <= half:
                x = F.pad(x, (0, half + 1 - x.numel()))
            spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=self._window, return_complex=True)[:, a:frames]
        else:  # from a*hop - half on, with the end's reflect padding
            x = torch.from_numpy(samples[a * cfg.hop_length - half:])
            x = F.pad(x[None, None], (0, half), mode="reflect")[0, 0]
            spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=self._window, center=False,
                              return_complex=True)[:, : frames - a]
        return log10_mel(self._filters, spec.abs() ** 2)

    def _store(self, raw: torch.Tensor) -> None:
        k = raw.shape[1]
        if not k:
            return
        if self.final + k > self._raw.shape[1]:
            grown = torch.empty(self._raw.shape[0], max(self.final + k, 2 * self._raw.shape[1]))
            grown[:, : self.final] = self._raw[:, : self.final]
            self._raw = grown
        self._raw[:, self.final:self.final + k] = raw
        self.final += k
        self._final_max = torch.maximum(self._final_max, raw.max())

    def raw(self, f0: int, f1: int) -> torch.Tensor:
        """Unclamped log10 mel of frames [f0, f1)."""
        if f1 <= self.final:
            return self._raw[:, f0:f1]
        if f0 >= self.final:
            return self._open[:, f0 - self.final:f1 - self.final]
        return torch.cat([self._raw[:, f0:self.final], self._open[:, : f1 - self.final]], 1)

    def features(self, f0: int, f1: int) -> torch.Tensor:
        """Model features of frames [f0, f1)."""
        return (torch.maximum(self.raw(f0, f1), self.floor) + 4.0) / 4.0

    def clamps(self, f0: int, f1: int, floor: float) -> bool:
        """Whether frames [f0, f1) read differently under ``floor`` than under the current floor."""
        now = float(self.floor)
        if now == floor:
            return False
        return float(self.raw(f0, f1).min()) < max(now, floor)
