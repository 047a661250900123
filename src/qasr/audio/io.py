"""Any supported input -> mono float32 16 kHz waveform in [-1, 1]; every failure an AudioError naming the input."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import av
import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16000

# A 2-D array's axis is read as channels only if it is at most this long.
MAX_CHANNELS = 8

# Every front end's words for a 0-byte input, after its name.
EMPTY_FILE = "the file is empty (0 bytes)"


@dataclass(frozen=True)
class EncodedAudio:
    """An upload, decoded like a file. ``opener()``: a fresh seekable handle per pass; ``watch``: called with
    the seconds decoded so far, may raise AudioError to stop."""

    name: str
    opener: Callable[[], IO[bytes]]
    size: int  # bytes; 0 is refused with EMPTY_FILE
    watch: Callable[[float], None] | None = None


AudioSource = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray | tuple | EncodedAudio


class AudioError(ValueError):
    """An input that cannot become a waveform; the message starts with the input's name."""


def audio_duration(x: np.ndarray) -> float:
    """Seconds of a 16 kHz waveform."""
    return len(x) / SAMPLE_RATE


def load_audio(source: AudioSource, sample_rate: int | None = None) -> np.ndarray:
    """``source`` as contiguous mono float32 at 16 kHz in [-1, 1].

    ``source``: a path, encoded bytes or EncodedAudio (whatever libsndfile or FFmpeg reads; the file's
    rate wins), an array with ``sample_rate``, or ``(array, sr)``. Integers are scaled to full scale
    (unsigned ones centred first). As the official package: after resampling, a peak above 1 divides
    the signal, then it is clipped; quieter audio is never amplified."""
    if isinstance(source, tuple):
        return _load_tuple(source, sample_rate)
    if isinstance(source, np.ndarray):
        if sample_rate is None:
            raise AudioError("array input: sample_rate is required when passing a bare array")
        return _load_array(source, sample_rate)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise AudioError(f"bytes input: {EMPTY_FILE}")
        return _load_encoded(lambda: io.BytesIO(data), "bytes input")
    if isinstance(source, (str, os.PathLike)):
        return _load_path(source)
    if isinstance(source, EncodedAudio):
        checked_encoded(source)
        return _load_encoded(source.opener, source.name, source.watch)
    raise AudioError(
        f"input of type {type(source).__name__}: unsupported audio source "
        "(expected a path, bytes, a numpy array or an (array, sample_rate) tuple)"
    )


def _load_tuple(source: tuple, sample_rate: int | None) -> np.ndarray:
    if len(source) != 2 or not isinstance(source[0], np.ndarray):
        raise AudioError("array input: a tuple source must be (numpy array, sample_rate)")
    array, sr = source
    sr = _check_rate(sr)
    if sample_rate is not None and _check_rate(sample_rate) != sr:
        raise AudioError(f"array input: tuple sample rate {sr} conflicts with sample_rate={sample_rate}")
    return _load_array(array, sr)


def _load_array(array: np.ndarray, sample_rate: Any) -> np.ndarray:
    name = "array input"
    sr = _check_rate(sample_rate)
    x = _to_float32(array, name)
    return _finish(_to_mono(x, name), sr, name)


def _load_path(source: str | os.PathLike) -> np.ndarray:
    path = checked_path(source)
    return _load_encoded(lambda: path, path)


def checked_path(source: str | os.PathLike) -> str:
    """The path as a str, or AudioError (missing, a directory, empty)."""
    path = os.fspath(source)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not os.path.exists(path):
        raise AudioError(f"{path}: file not found")
    if os.path.isdir(path):
        raise AudioError(f"{path}: is a directory, not an audio file")
    if os.path.getsize(path) == 0:
        raise AudioError(f"{path}: {EMPTY_FILE}")
    return path


def checked_encoded(source: EncodedAudio) -> EncodedAudio:
    """The upload, or AudioError when it is empty."""
    if source.size == 0:
        raise AudioError(f"{source.name}: {EMPTY_FILE}")
    return source


def _load_encoded(opener: Callable[[], Any], name: str, watch: Callable[[float], None] | None = None) -> np.ndarray:
    """libsndfile, else PyAV; ``opener()`` gives a fresh handle per attempt (a failed one moves a BytesIO)."""
    try:
        data, sr = sf.read(opener(), dtype="float32", always_2d=True)
    except Exception as sf_exc:
        try:
            channels_first, sr = _decode_with_av(opener(), watch)
        except AudioError:
            raise
        except Exception as av_exc:
            raise AudioError(
                f"{name}: cannot be decoded as audio (soundfile: {_short(sf_exc)}; pyav: {_short(av_exc)})"
            ) from av_exc
        mono = channels_first.mean(axis=0, dtype=np.float32) if channels_first.size else np.zeros(0, "f4")
        return _finish(mono, sr, name)
    if watch is not None:
        watch(data.shape[0] / sr)
    if data.shape[0] == 0:
        # libsndfile may count zero frames (some VBR mp3); FFmpeg scans to the end
        try:
            channels_first, av_sr = _decode_with_av(opener(), watch)
        except AudioError:
            raise
        except Exception:
            channels_first, av_sr = np.zeros((1, 0), dtype=np.float32), sr
        if channels_first.size:
            return _finish(channels_first.mean(axis=0, dtype=np.float32), av_sr, name)
    return _finish(data.mean(axis=1, dtype=np.float32), sr, name)


def _decode_with_av(handle: Any, watch: Callable[[float], None] | None = None) -> tuple[np.ndarray, int]:
    """(channels, samples) float32 at the input's rate."""
    with av.open(handle, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream found")
        track = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp")
        blocks: list[np.ndarray] = []
        rate = 0
        samples = 0
        for frame in container.decode(track):
            for out in resampler.resample(frame):
                rate = out.sample_rate
                blocks.append(out.to_ndarray())
                samples += out.samples
            if watch is not None and rate:
                watch(samples / rate)
        for out in resampler.resample(None):
            rate = out.sample_rate
            blocks.append(out.to_ndarray())
        if not blocks:
            return np.zeros((1, 0), dtype=np.float32), track.rate or SAMPLE_RATE
        return np.concatenate(blocks, axis=1).astype(np.float32, copy=False), rate


def _to_float32(array: np.ndarray, name: str) -> np.ndarray:
    """Any real dtype -> float32 at full scale [-1, 1)."""
    kind = array.dtype.kind
    if kind == "f":
        return array.astype(np.float32, copy=False)
    if kind == "i":
        scale = float(2 ** (8 * array.dtype.itemsize - 1))
        return array.astype(np.float32) / np.float32(scale)
    if kind == "u":
        half = float(2 ** (8 * array.dtype.itemsize - 1))
        return (array.astype(np.float32) - np.float32(half)) / np.float32(half)
    raise AudioError(f"{name}: unsupported sample dtype {array.dtype} (expected integer or float samples)")


def _to_mono(x: np.ndarray, name: str) -> np.ndarray:
    """Channels averaged: (C, T) when C <= MAX_CHANNELS and C < T, else (T, C) when C <= MAX_CHANNELS."""
    if x.ndim == 1:
        return x
    if x.ndim != 2:
        raise AudioError(f"{name}: expected a 1-D or 2-D array, got shape {x.shape}")
    rows, cols = x.shape
    if rows <= MAX_CHANNELS and rows < cols:
        return x.mean(axis=0, dtype=np.float32)
    if cols <= MAX_CHANNELS:
        return x.mean(axis=1, dtype=np.float32)
    raise AudioError(
        f"{name}: cannot tell channels from time in shape {x.shape} (neither axis is <= {MAX_CHANNELS})"
    )


def _finish(mono: np.ndarray, sr: int, name: str) -> np.ndarray:
    if mono.size == 0:
        raise AudioError(f"{name}: contains no audio samples")
    if not np.isfinite(mono).all():
        raise AudioError(f"{name}: contains NaN or infinite samples")
    if sr != SAMPLE_RATE:
        mono = soxr.resample(np.ascontiguousarray(mono), sr, SAMPLE_RATE, quality="HQ")
        if mono.size == 0:
            raise AudioError(f"{name}: contains no audio samples (too short to resample to 16 kHz)")
    peak = float(np.max(np.abs(mono)))
    if peak > 1.0:
        mono = mono / np.float32(peak)
    return np.ascontiguousarray(np.clip(mono, -1.0, 1.0), dtype=np.float32)


def _check_rate(sample_rate: Any) -> int:
    """A positive integral rate (44100.0 and numpy integers too), else AudioError."""
    try:
        rate = int(sample_rate)
        valid = not isinstance(sample_rate, bool) and rate == sample_rate and rate > 0
    except (TypeError, ValueError, OverflowError):
        valid = False
    if not valid:
        raise AudioError(f"array input: invalid sample rate {sample_rate!r} (expected a positive integer)")
    return rate


# decoders' words for a file object: noise after the input's name
_HANDLE_NOISE = re.compile(r"(Error opening )?<[\w.]+ object at 0x[0-9a-fA-F]+>(: )?"
                           r"|:? ?'(?:<none>|None)'|\[Errno -?\d+\] ")


def _short(exc: BaseException) -> str:
    text = _HANDLE_NOISE.sub("", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def named_audio_error(exc: ValueError, name: str) -> AudioError:
    """An AudioError whose message starts with ``name``."""
    msg = str(exc)
    for generic in ("bytes input", "array input"):
        if name.startswith(generic) and msg.startswith(generic) and not msg.startswith(name):
            msg = name + msg[len(generic):]
    return AudioError(msg if msg.startswith(name) else f"{name}: {msg}")


def checked_segments(segments: Iterator, name: str) -> Iterator:
    """Re-raise a decode error met midway through an input under its own name."""
    try:
        yield from segments
    except ValueError as exc:
        raise named_audio_error(exc, name) from exc
    except (OSError, RuntimeError) as exc:
        raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc
