"""Encoder outputs of a growing stream, by 8 s attention window.

The encoder attends only inside windows of ``window_tokens`` (8 s) aligned at the stream start, its
conv front end works on 1 s conv chunks inside them, and qasr's encoder gives a window the same bits
alone or packed with others. So the output of a window whose frames are all final is kept, and each
step encodes only the open window (plus, rarely, kept windows whose features a rise of the log-mel
maximum changed: detected per window from its lowest raw value and the floor it was made under).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qasr.engine.engine import Engine
from qasr.streaming.logmel import StreamingLogMel


@dataclass(frozen=True)
class KeptWindow:
    rows: torch.Tensor  # (window_tokens, hidden) encoder output
    floor: float  # the clamp floor its features were made under


class WindowEncoder:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # encodes on its own thread, packed with other sessions' windows and files' audio
        enc = engine.checkpoint.config.encoder
        self.window_frames = enc.window_tokens // enc.tokens_per_conv_chunk * enc.conv_chunk_frames
        self.kept: list[KeptWindow] = []
        self.used: tuple[KeptWindow, ...] = ()

    def encode(self, mel: StreamingLogMel) -> tuple[torch.Tensor, int, int]:
        """Encoder output for all the stream's frames; returns (rows, tokens computed now, kept windows
        recomputed because the clamp floor moved under them). ``self.used`` then lists the kept windows
        the rows begin with (the same objects while unchanged: the decoder's KV reuse compares them)."""
        wf = self.window_frames
        closed = mel.final // wf  # windows whose frames are all final
        floor = float(mel.floor)
        recomputed = 0
        computed = 0
        for w in range(closed):
            if w < len(self.kept) and not mel.clamps(w * wf, (w + 1) * wf, self.kept[w].floor):
                continue
            rows = self._run(mel.features(w * wf, (w + 1) * wf))
            computed += rows.shape[0]
            entry = KeptWindow(rows, floor)
            if w < len(self.kept):
                self.kept[w] = entry
                recomputed += 1
            else:
                self.kept.append(entry)
        self.used = tuple(self.kept[:closed])
        parts = [k.rows for k in self.used]
        if mel.frames > closed * wf:
            open_rows = self._run(mel.features(closed * wf, mel.frames))
            computed += open_rows.shape[0]
            parts.append(open_rows)
        return torch.cat(parts), computed, recomputed

    def _run(self, features: torch.Tensor) -> torch.Tensor:
        return self.engine.submit_encode(features).result()
