"""Encoder output of a growing stream by 8 s window, keeping the rows of final windows and the conv output of
the open window's final chunks; and how a stream waits for the engine's answers."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from qasr.engine.engine import Engine
from qasr.engine.request import EncodeResult
from qasr.streaming.logmel import StreamingLogMel

T = TypeVar("T")


class EngineTimeout(TimeoutError):
    """A stream's engine request went unanswered for its ``engine_timeout_s`` and was cancelled."""


def answer(future: Future[T], timeout_s: float | None) -> T:
    """``future.result()``, waiting at most ``timeout_s`` seconds (None: no limit); past it the request is
    cancelled and EngineTimeout raised."""
    try:
        return future.result(timeout_s)
    except TimeoutError:
        if future.done() or not future.cancel():  # its own error, or it came meanwhile
            return future.result()
        raise EngineTimeout(f"the engine has not answered for {timeout_s:g} s") from None


@dataclass(frozen=True)
class KeptWindow:
    rows: torch.Tensor  # (window_tokens, hidden)
    floor: float  # the clamp floor of its features


@dataclass(frozen=True)
class KeptChunk:
    conv: torch.Tensor  # (tokens_per_conv_chunk, d_model)
    floor: float


@dataclass(frozen=True)
class WindowEncoding:
    rows: torch.Tensor  # of all the stream's frames
    computed: int  # this step's rows, windows redone, chunks convolved
    recomputed: int
    conv_chunks: int


class WindowEncoder:
    def __init__(self, engine: Engine, timeout_s: float | None = None) -> None:
        """``timeout_s``: how long an encode may go unanswered (``answer``)."""
        self.engine = engine
        self.timeout_s = timeout_s
        enc = engine.checkpoint.config.encoder
        self.chunk_frames = enc.conv_chunk_frames
        self.window_frames = enc.window_tokens // enc.tokens_per_conv_chunk * enc.conv_chunk_frames
        self.kept: list[KeptWindow] = []
        self.used: tuple[KeptWindow, ...] = ()
        # the conv output of the whole final chunks that open window ``_chunks_window``
        self._chunks: list[KeptChunk] = []
        self._chunks_window = 0

    def encode(self, mel: StreamingLogMel) -> WindowEncoding:
        """Encoder output for all the stream's frames; ``used``: the kept windows they begin with (the same
        objects while unchanged)."""
        wf = self.window_frames
        closed = mel.final // wf  # windows whose frames are all final
        floor = float(mel.floor)
        recomputed = computed = convolved = 0
        for w in range(closed):
            if w < len(self.kept) and not mel.clamps(w * wf, (w + 1) * wf, self.kept[w].floor):
                continue
            result = self._run(mel, w)
            computed += result.rows.shape[0]
            convolved += result.conv.shape[0]
            entry = KeptWindow(result.rows, floor)
            if w < len(self.kept):
                self.kept[w] = entry
                recomputed += 1
            else:
                self.kept.append(entry)
        self.used = tuple(self.kept[:closed])
        parts = [k.rows for k in self.used]
        if mel.frames > closed * wf:
            result = self._run(mel, closed)
            computed += result.rows.shape[0]
            convolved += result.conv.shape[0]
            parts.append(result.rows)
        return WindowEncoding(torch.cat(parts), computed, recomputed, convolved)

    def _run(self, mel: StreamingLogMel, window: int) -> EncodeResult:
        """Encode window ``window`` as far as the stream goes, with its final chunks' kept conv output."""
        cf, start = self.chunk_frames, window * self.window_frames
        end = min(mel.frames, start + self.window_frames)
        if window != self._chunks_window:
            if window < self._chunks_window:  # a closed window redone: not the chunks held
                return answer(self.engine.submit_encode(mel.features(start, end)), self.timeout_s)
            self._chunks, self._chunks_window = [], window
        held = 0
        for j, chunk in enumerate(self._chunks):
            if mel.clamps(start + j * cf, start + (j + 1) * cf, chunk.floor):
                break
            held += 1
        del self._chunks[held:]
        head = torch.stack([c.conv for c in self._chunks]) if held else None
        result = answer(self.engine.submit_encode(mel.features(start + held * cf, end), conv_head=head),
                        self.timeout_s)
        floor = float(mel.floor)
        whole_final = (min(mel.final, end) - start) // cf
        for j in range(held, whole_final):  # a copy: a view would hold the packed call's whole output
            self._chunks.append(KeptChunk(result.conv[j - held].clone(), floor))
        return result
