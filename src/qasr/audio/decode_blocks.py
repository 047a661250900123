"""Block-wise decoding to mono float32 at the input's rate: the blocks, joined, are what ``load_audio`` resamples."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import av
import numpy as np
import soundfile as sf

from qasr.audio.io import AudioError, _short

# libsndfile subtypes whose samples lie in [-1, 1] by construction; others may decode above full scale.
_BOUNDED_SUBTYPES = ("PCM_", "ULAW", "ALAW")
# Subtypes libsndfile decodes the same whole or in blocks (not its compressed codecs, see docs/log's
# audio-block-decoding entry): those are read whole when short, by PyAV when long.
_BLOCKWISE_SUBTYPES = ("PCM_", "ULAW", "ALAW", "FLOAT", "DOUBLE")
# Up to this duration a compressed input libsndfile reads is decoded in one call, as load_audio does.
ONE_SHOT_MAX_S = 600.0


class BlockDecoder:
    """An encoded input, probed on construction; each ``blocks()`` is one pass. ``duration``: the container's
    seconds, or None; ``bounded``: samples cannot exceed 1."""

    def __init__(self, opener: Callable[[], Any], name: str, block_s: float,
                 watch: Callable[[float], None] | None = None) -> None:
        self._opener = opener
        self.name = name
        self._block_s = block_s
        self._watch = watch
        self._empty = False
        self.duration: float | None = None
        try:
            with sf.SoundFile(opener()) as f:
                self.rate, frames, subtype = int(f.samplerate), int(f.frames), str(f.subtype)
            sf_error: BaseException | None = None
        except Exception as exc:
            frames, sf_error = 0, exc
        self.bounded = False
        if frames > 0:
            self.duration = frames / self.rate
            self.bounded = subtype.startswith(_BOUNDED_SUBTYPES)
            if subtype.startswith(_BLOCKWISE_SUBTYPES):
                self.method = "soundfile"
                return
            self.method = "soundfile-whole"
            if self.duration <= ONE_SHOT_MAX_S:
                return
            try:  # too long to hold whole: FFmpeg, block by block
                self.rate, self.duration = _probe_av(opener())
                self.method = "pyav"
            except Exception:
                pass
            return
        self.method = "pyav"
        try:
            self.rate, self.duration = _probe_av(opener())
        except Exception as av_exc:
            if sf_error is None:  # zero frames: an empty input, not a bad one
                self.rate, self.duration = 16000, 0.0
                self._empty = True
                return
            raise AudioError(
                f"{name}: cannot be decoded as audio (soundfile: {_short(sf_error)}; pyav: {_short(av_exc)})"
            ) from av_exc

    @property
    def _block(self) -> int:
        return max(1, int(self._block_s * self.rate))

    def blocks(self) -> Iterator[np.ndarray]:
        """Mono float32 blocks at ``rate``; decoding errors as AudioError naming the input."""
        try:
            if self.method == "soundfile":
                blocks = self._sf_blocks()
            elif self.method == "soundfile-whole":
                blocks = self._sf_whole()
            else:
                blocks = iter(()) if self._empty else self._av_blocks()
            samples = 0
            for block in blocks:
                samples += block.size
                if self._watch is not None:  # before handing it on: a refused block goes nowhere
                    self._watch(samples / self.rate)
                yield block
        except AudioError:
            raise
        except Exception as exc:
            raise AudioError(f"{self.name}: decoding failed: {_short(exc)}") from exc

    def _sf_blocks(self) -> Iterator[np.ndarray]:
        with sf.SoundFile(self._opener()) as f:
            while True:
                data = f.read(frames=self._block, dtype="float32", always_2d=True)
                if data.shape[0] == 0:
                    return
                yield data.mean(axis=1, dtype=np.float32)

    def _sf_whole(self) -> Iterator[np.ndarray]:
        data, _ = sf.read(self._opener(), dtype="float32", always_2d=True)
        mono = data.mean(axis=1, dtype=np.float32)
        del data
        for i in range(0, mono.size, self._block):
            yield mono[i : i + self._block]

    def _av_blocks(self) -> Iterator[np.ndarray]:
        with av.open(self._opener(), mode="r") as container:
            track = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp")
            parts: list[np.ndarray] = []
            size = 0

            def frames_out(frame: Any) -> Iterator[np.ndarray]:
                for out in resampler.resample(frame):
                    if out.sample_rate != self.rate:
                        raise ValueError(f"sample rate changes mid-stream ({self.rate} -> {out.sample_rate})")
                    yield out.to_ndarray().mean(axis=0, dtype=np.float32)

            for frame in container.decode(track):
                for mono in frames_out(frame):
                    parts.append(mono)
                    size += mono.size
                if size >= self._block:  # blocks, not FFmpeg's frames
                    yield np.concatenate(parts)
                    parts, size = [], 0
            parts.extend(frames_out(None))
            if parts:
                yield np.concatenate(parts)


def _probe_av(handle: Any) -> tuple[int, float | None]:
    with av.open(handle, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream found")
        track = container.streams.audio[0]
        rate = int(track.rate or track.codec_context.sample_rate or 0)
        if rate <= 0:
            raise ValueError("the audio stream has no sample rate")
        if track.duration is not None and track.time_base is not None:
            return rate, float(track.duration * track.time_base)
        if container.duration is not None:
            return rate, container.duration / av.time_base
        return rate, None
