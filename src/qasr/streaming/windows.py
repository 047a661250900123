"""Encoder outputs of a growing stream, by 8 s attention window.

The encoder attends only inside windows of ``window_tokens`` (8 s) aligned at the stream start, its
conv front end works on 1 s conv chunks inside them, and qasr's encoder gives a window the same bits
alone or packed with others. So the output of a window whose frames are all final is kept, and each
step encodes only the open window (plus, rarely, kept windows whose features a rise of the log-mel
maximum changed: detected per window from its lowest raw value and the floor it was made under).

Inside the open window the same holds one level down: a conv chunk convolves alone, so the conv
output of a chunk whose frames are all final is kept too and handed back to the engine as the
window's conv head; a step then convolves only the chunks that changed (about two a step, where it
convolved the whole open window, up to nine), and only the transformer layers run over the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qasr.engine.engine import Engine
from qasr.engine.request import EncodeResult
from qasr.streaming.logmel import StreamingLogMel


@dataclass(frozen=True)
class KeptWindow:
    rows: torch.Tensor  # (window_tokens, hidden) encoder output
    floor: float  # the clamp floor its features were made under


@dataclass(frozen=True)
class KeptChunk:
    conv: torch.Tensor  # (tokens_per_conv_chunk, d_model) conv front end output of one whole final chunk
    floor: float  # the clamp floor its features were made under


@dataclass(frozen=True)
class WindowEncoding:
    rows: torch.Tensor  # the encoder output of all the stream's frames
    computed: int  # encoder rows computed this step
    recomputed: int  # kept windows recomputed because the clamp floor moved under them
    conv_chunks: int  # conv chunks convolved this step


class WindowEncoder:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # encodes on its own thread, packed with other sessions' windows and files' audio
        enc = engine.checkpoint.config.encoder
        self.chunk_frames = enc.conv_chunk_frames
        self.window_frames = enc.window_tokens // enc.tokens_per_conv_chunk * enc.conv_chunk_frames
        self.kept: list[KeptWindow] = []
        self.used: tuple[KeptWindow, ...] = ()
        # the conv output of the whole final chunks at the start of window ``_chunks_window`` (the open one)
        self._chunks: list[KeptChunk] = []
        self._chunks_window = 0

    def encode(self, mel: StreamingLogMel) -> WindowEncoding:
        """Encoder output for all the stream's frames. ``self.used`` then lists the kept windows the rows
        begin with (the same objects while unchanged: the decoder's KV reuse compares them)."""
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
        """Encode window ``window`` as far as the stream goes, reusing the kept conv output of its first
        chunks when they are the open window's (their features unchanged), and keeping the conv output
        of its whole final chunks for the next step."""
        cf, start = self.chunk_frames, window * self.window_frames
        end = min(mel.frames, start + self.window_frames)
        if window != self._chunks_window:
            if window < self._chunks_window:  # a closed window redone: its chunks are not the ones held
                return self.engine.submit_encode(mel.features(start, end)).result()
            self._chunks, self._chunks_window = [], window
        held = 0
        for j, chunk in enumerate(self._chunks):
            if mel.clamps(start + j * cf, start + (j + 1) * cf, chunk.floor):
                break
            held += 1
        del self._chunks[held:]
        head = torch.stack([c.conv for c in self._chunks]) if held else None
        result = self.engine.submit_encode(mel.features(start + held * cf, end), conv_head=head).result()
        floor = float(mel.floor)
        whole_final = (min(mel.final, end) - start) // cf
        for j in range(held, whole_final):  # a copy: the row is a view of the packed call's output, all sessions'
            self._chunks.append(KeptChunk(result.conv[j - held].clone(), floor))
        return result
