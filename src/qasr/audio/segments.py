"""The online segmenter: 16 kHz blocks of any size -> segments, the same whatever the blocks.

"vad": speech regions joined up to ``max_s``, cut at the longest gap (a longer region at its
quietest point); "fixed": windows of ``max_s``; "none": whole, cut past ``NONE_MAX_S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from qasr.audio.io import SAMPLE_RATE
from qasr.audio.split import _quiet_boundary
from qasr.audio.vad import SpeechDetector, VadConfig

SegmentMode = Literal["vad", "fixed", "none"]
MODES = ("vad", "fixed", "none")
QUIET_SEARCH_S = 5.0  # how far before the limit a single over-long region may be cut
NONE_MAX_S = 1200.0  # the model's per-request limit, honoured in mode "none"
_SEARCH_S = 5.0  # split_long_audio's search half-width
_QUIET_WINDOW = int(0.1 * SAMPLE_RATE)


@dataclass(frozen=True)
class AudioSegment:
    """``samples``: the 16 kHz audio of ``[start, end)``, seconds in the input."""

    start: float
    end: float
    samples: np.ndarray

    @property
    def start_sample(self) -> int:
        return round(self.start * SAMPLE_RATE)

    @property
    def duration(self) -> float:
        return self.end - self.start


class _Buffer:
    """The input's recent audio, samples ``base`` to ``end`` (absolute offsets), in a reused array."""

    def __init__(self) -> None:
        self._data = np.zeros(1 << 16, dtype=np.float32)
        self._lo = 0  # index of sample ``base`` in _data
        self._hi = 0  # index one past the last sample
        self.base = 0

    @property
    def end(self) -> int:
        return self.base + self._hi - self._lo

    def append(self, block: np.ndarray) -> None:
        held = self._hi - self._lo
        if self._hi + block.size > self._data.size:
            if held + block.size > self._data.size // 2:
                grown = np.zeros(max(2 * (held + block.size), self._data.size), dtype=np.float32)
                grown[:held] = self._data[self._lo : self._hi]
                self._data = grown
            else:
                self._data[:held] = self._data[self._lo : self._hi]
            self._lo, self._hi = 0, held
        self._data[self._hi : self._hi + block.size] = block
        self._hi += block.size

    def view(self, lo: int, hi: int) -> np.ndarray:
        if lo < self.base or hi > self.end or lo > hi:
            raise AssertionError(f"segmenter lost audio: wants [{lo}, {hi}), holds [{self.base}, {self.end})")
        return self._data[self._lo + lo - self.base : self._lo + hi - self.base]

    def drop_before(self, offset: int) -> None:
        cut = min(max(offset - self.base, 0), self._hi - self._lo)
        self._lo += cut
        self.base += cut


class Segmenter:
    """``feed(block)`` returns the segments each block finished, ``flush()`` the rest; in order, never
    overlapping, their samples copies. ``max_s`` must exceed the VAD's shortest padded region."""

    def __init__(self, mode: SegmentMode = "vad", max_s: float = 30.0, vad: VadConfig | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"segmentation mode must be one of {MODES}, got {mode!r}")
        vad = vad or VadConfig()
        if mode == "vad" and max_s <= vad.min_speech_s + 2 * vad.speech_pad_s:
            raise ValueError(f"segments of at most {max_s} s are too short for the VAD's shortest region")
        if max_s <= 0:
            raise ValueError(f"the segment length must be positive, got {max_s}")
        self.mode = mode
        self.max_s = max_s
        self._max = int(round(max_s * SAMPLE_RATE))
        self._buf = _Buffer()
        self._detector = SpeechDetector(vad) if mode == "vad" else None
        self._regions: list[list[int]] = []  # finished regions of the segment under construction
        self._carry: int | None = None  # start override for the open region after cutting inside it
        self._start = 0  # "fixed"/"none": start of the segment under construction
        self._flushed = False

    @property
    def vad_backend(self) -> str | None:
        return self._detector.backend if self._detector is not None else None

    @property
    def held_samples(self) -> int:
        return self._buf.end - self._buf.base

    def feed(self, block: np.ndarray) -> list[AudioSegment]:
        if self._flushed:
            raise RuntimeError("Segmenter.feed after flush()")
        block = np.asarray(block, dtype=np.float32).reshape(-1)
        self._buf.append(block)
        out = self._cut(final=False, block=block)
        self._buf.drop_before(self._keep_from())
        return out

    def flush(self) -> list[AudioSegment]:
        """End of input: every remaining segment."""
        if self._flushed:
            return []
        self._flushed = True
        return self._cut(final=True)

    def _cut(self, final: bool, block: np.ndarray | None = None) -> list[AudioSegment]:
        out: list[AudioSegment] = []
        if self.mode == "fixed":
            self._fixed(out, final=final)
        elif self.mode == "none":
            self._none(out, final=final)
        else:
            assert self._detector is not None
            self._vad(self._detector.flush() if block is None else self._detector.feed(block), out, final=final)
        return out

    # modes "fixed" and "none"

    def _fixed(self, out: list[AudioSegment], final: bool) -> None:
        while self._buf.end - self._start >= self._max:
            self._emit(self._start, self._start + self._max, out)
            self._start += self._max
        if final and self._buf.end > self._start:
            self._emit(self._start, self._buf.end, out)

    def _none(self, out: list[AudioSegment], final: bool) -> None:
        # split_long_audio's loop, each cut made once the audio 5 s past it has come
        max_len = int(NONE_MAX_S * SAMPLE_RATE)
        reach = int(_SEARCH_S * SAMPLE_RATE)
        while True:
            total = self._buf.end
            cut = self._start + max_len
            if not (total > cut + reach or (final and total - self._start > max_len)):
                break
            lo, hi = max(self._start, cut - reach), min(total, cut + reach)
            view = self._buf.view(self._buf.base, total)
            boundary = self._buf.base + _quiet_boundary(view, cut - self._buf.base, lo - self._buf.base,
                                                        hi - self._buf.base, _QUIET_WINDOW)
            boundary = min(max(boundary, self._start + 1), total)
            self._emit(self._start, boundary, out)
            self._start = boundary
        if final and self._buf.end > self._start:
            self._emit(self._start, self._buf.end, out)

    # mode "vad"

    def _vad(self, regions: list[tuple[int, int]], out: list[AudioSegment], final: bool) -> None:
        assert self._detector is not None
        for start, end in regions:
            if self._carry is not None:
                start, self._carry = max(start, self._carry), None
            if end > start:
                self._regions.append([start, end])
            self._settle(out)
        if final:
            while self._regions:
                self._emit_regions(len(self._regions), out)
        else:
            self._settle_open(out)

    def _settle(self, out: list[AudioSegment]) -> None:
        regs = self._regions
        while regs:
            seg_start = regs[0][0]
            last_start, last_end = regs[-1]
            if last_end - seg_start <= self._max:
                return
            if len(regs) > 1 and last_start >= seg_start + self._max:
                self._emit_regions(len(regs) - 1, out)
            elif len(regs) > 1:
                self._emit_regions(self._longest_gap(regs, last_start), out)
            else:
                self._cut_region(out)

    def _settle_open(self, out: list[AudioSegment]) -> None:
        assert self._detector is not None
        while True:
            regs = self._regions
            open_region = self._detector.open_region
            if regs:
                limit = regs[0][0] + self._max
                if open_region is None:
                    if self._detector.frontier >= limit:  # nothing later can join this segment
                        self._emit_regions(len(regs), out)
                    return
                open_start, open_end = open_region
                if open_start >= limit:
                    self._emit_regions(len(regs), out)
                elif open_end > limit:
                    cut = self._longest_gap(regs + [[open_start, open_end]], open_start)
                    self._emit_regions(cut, out)
                else:
                    return
            else:
                if open_region is None:
                    return
                start = open_region[0] if self._carry is None else max(open_region[0], self._carry)
                if open_region[1] - start <= self._max:
                    return
                boundary = self._quiet_cut(start)
                self._emit(start, boundary, out)
                self._carry = boundary

    def _longest_gap(self, regs: list[list[int]], next_start: int) -> int:
        """How many leading regions precede the longest gap (the latest among equals)."""
        ends = [r[1] for r in regs[:-1]]
        starts = [r[0] for r in regs[1:]]
        gaps = [s - e for e, s in zip(ends, starts, strict=True)]
        best = max(range(len(gaps)), key=lambda i: (gaps[i], i))
        return best + 1

    def _cut_region(self, out: list[AudioSegment]) -> None:
        start, end = self._regions[0]
        boundary = self._quiet_cut(start)
        self._emit(start, boundary, out)
        self._regions[0] = [boundary, end]

    def _quiet_cut(self, start: int) -> int:
        limit = start + self._max
        lo = max(start + 1, limit - int(min(QUIET_SEARCH_S, self.max_s / 2) * SAMPLE_RATE))
        view = self._buf.view(start, limit)
        boundary = start + _quiet_boundary(view, limit - start, lo - start, limit - start, _QUIET_WINDOW)
        return min(max(boundary, start + 1), limit)

    def _emit_regions(self, count: int, out: list[AudioSegment]) -> None:
        taken = self._regions[:count]
        del self._regions[:count]
        self._emit(taken[0][0], taken[-1][1], out)

    def _keep_from(self) -> int:
        if self.mode != "vad":
            return self._start
        assert self._detector is not None
        if self._regions:
            return self._regions[0][0]
        if self._carry is not None:
            return self._carry
        return self._detector.frontier

    def _emit(self, start: int, end: int, out: list[AudioSegment]) -> None:
        samples = self._buf.view(start, end).copy()
        out.append(AudioSegment(start=start / SAMPLE_RATE, end=end / SAMPLE_RATE, samples=samples))


def segment_audio(
    wave: np.ndarray, mode: SegmentMode = "vad", max_s: float = 30.0, vad: VadConfig | None = None
) -> list[AudioSegment]:
    """The segments of a whole 16 kHz waveform."""
    segmenter = Segmenter(mode, max_s, vad)
    return segmenter.feed(wave) + segmenter.flush()
