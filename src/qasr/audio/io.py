"""Audio loading: any supported input -> mono float32 16 kHz waveform.

Qwen3-ASR consumes 16 kHz mono audio in [-1, 1]. This module is the single place where files, encoded
bytes and in-memory arrays are brought to that form, so the rest of the engine can assume it. Every
failure surfaces as :class:`AudioError` naming the input, because decoder exceptions (libsndfile,
FFmpeg) are cryptic and rarely say *which* file was bad.
"""

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

# A 2-D array axis is only taken to be the channel axis if it is at most this long; anything larger
# is far more likely to be time (or a batch of clips), and silently averaging it would be garbage.
MAX_CHANNELS = 8

# How every front end describes a 0-byte input (CLI path, server upload, bytes), after the input's name.
EMPTY_FILE = "the file is empty (0 bytes)"


@dataclass(frozen=True)
class EncodedAudio:
    """Encoded audio that has no path of its own (an HTTP upload): decoded like a file, named by ``name``.

    ``opener()`` returns a readable, seekable binary handle positioned at the start, once per decoding
    pass (passes never overlap, so it may hand out the same rewound file each time). ``watch``, when set,
    is called with the seconds decoded so far (at the input's own rate) after each decoded block of every
    pass; it may raise AudioError to stop decoding there (a server stops an upload that decodes to more
    audio than it admitted).
    """

    name: str
    opener: Callable[[], IO[bytes]]
    size: int  # bytes; 0 is refused with EMPTY_FILE before any decoder sees it
    watch: Callable[[float], None] | None = None


AudioSource = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray | tuple | EncodedAudio


class AudioError(ValueError):
    """Raised when an input cannot be turned into a usable waveform.

    The message always starts with the input's name (the path, an upload's name, ``"bytes input"`` or
    ``"array input"``) so a failure in a batch of hundreds of files points at the culprit.
    """


def audio_duration(x: np.ndarray) -> float:
    """Duration in seconds of a mono waveform sampled at :data:`SAMPLE_RATE`."""
    return len(x) / SAMPLE_RATE


def load_audio(source: AudioSource, sample_rate: int | None = None) -> np.ndarray:
    """Load ``source`` as a contiguous mono float32 array at 16 kHz with samples in [-1, 1].

    Accepted sources:

    * a path (``str`` or ``os.PathLike``) to wav, flac, mp3, ogg/opus, m4a, webm, or anything else
      libsndfile or FFmpeg can read. libsndfile is tried first (fast, exact for PCM/FLAC); containers it
      does not understand (m4a/AAC, webm, ...) fall back to PyAV.
    * ``bytes``/``bytearray``/``memoryview`` holding an encoded file, decoded the same way.
      For these encoded inputs the file's own sample rate is authoritative and ``sample_rate`` is ignored.
    * a numpy array; ``sample_rate`` (the array's rate) is then required.
    * a tuple ``(array, sr)``. If ``sample_rate`` is also given it must agree with ``sr``.
    * an :class:`EncodedAudio` (an upload without a path), decoded like a file.

    Array conventions: signed integers are scaled by ``2**(bits-1)`` (int16 / 32768, int32 / 2**31),
    unsigned integers are centred first (uint8: (x - 128) / 128), floats are cast to float32. See
    :func:`_to_mono` for how 2-D arrays are read as channels.

    Amplitude follows the official Qwen3-ASR rule: after resampling, if the peak ``|x|`` exceeds 1 the
    signal is divided by the peak; then it is clipped to [-1, 1]. Quieter audio is never amplified.
    """
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
    """The path as a str, or AudioError when it is missing or a directory (every decoder's first check)."""
    path = os.fspath(source)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not os.path.exists(path):
        raise AudioError(f"{path}: file not found")
    if os.path.isdir(path):
        raise AudioError(f"{path}: is a directory, not an audio file")
    if os.path.getsize(path) == 0:  # said plainly, not as two decoders' "format not recognised"
        raise AudioError(f"{path}: {EMPTY_FILE}")
    return path


def checked_encoded(source: EncodedAudio) -> EncodedAudio:
    """The upload itself, or AudioError when it is empty (the same words as for an empty path)."""
    if source.size == 0:
        raise AudioError(f"{source.name}: {EMPTY_FILE}")
    return source


def _load_encoded(opener: Callable[[], Any], name: str, watch: Callable[[float], None] | None = None) -> np.ndarray:
    """Decode with libsndfile, falling back to PyAV; ``opener()`` yields a fresh path or file object.

    A fresh handle per attempt matters for BytesIO: a failed decoder leaves the stream position anywhere.
    ``watch``: see :class:`EncodedAudio`. libsndfile reads only the frames its header declares, so it is
    watched once after its read; PyAV decodes whatever the file holds, so it is watched frame by frame.
    """
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
        # libsndfile can report zero frames for streams whose length it cannot determine (e.g. some
        # VBR mp3); FFmpeg scans to the end, so give it a chance before declaring the input empty.
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
    """Decode the first audio stream with FFmpeg; returns (channels, samples) float32 and its rate.

    The resampler only converts the sample format to planar float; rate and layout are kept so the
    resampling to 16 kHz is done by soxr, identically for every decoder. ``watch``: see EncodedAudio.
    """
    with av.open(handle, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream found")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp")
        blocks: list[np.ndarray] = []
        rate = 0
        samples = 0
        for frame in container.decode(stream):
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
            return np.zeros((1, 0), dtype=np.float32), stream.rate or SAMPLE_RATE
        return np.concatenate(blocks, axis=1).astype(np.float32, copy=False), rate


def _to_float32(array: np.ndarray, name: str) -> np.ndarray:
    """Convert any real numeric dtype to float32 in the conventional [-1, 1) full-scale range."""
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
    """Average channels of a 1-D or 2-D array.

    Rule for 2-D arrays: an axis of length 1 is squeezed away. Otherwise axis 0 is the channel axis if it
    is at most ``MAX_CHANNELS`` long and shorter than axis 1 (shape (C, T)); else axis 1 is the channel axis
    if it is at most ``MAX_CHANNELS`` long (shape (T, C), the soundfile convention, also used on ties).
    If neither axis is that short the layout is ambiguous and AudioError is raised.
    """
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
    """Validate, resample to 16 kHz and apply the official amplitude rule."""
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
    """Accept positive integral rates (including 44100.0 and numpy integers); reject anything else."""
    try:
        rate = int(sample_rate)
        valid = not isinstance(sample_rate, bool) and rate == sample_rate and rate > 0
    except (TypeError, ValueError, OverflowError):
        valid = False
    if not valid:
        raise AudioError(f"array input: invalid sample rate {sample_rate!r} (expected a positive integer)")
    return rate


# What decoders put in their messages about a file object: libsndfile its repr ("Error opening
# <_io.BytesIO object at 0x7efe...>: "), FFmpeg its placeholder name (": '<none>'") and an errno. The
# message already starts with the input's own name, so these say nothing and are dropped.
_HANDLE_NOISE = re.compile(r"(Error opening )?<[\w.]+ object at 0x[0-9a-fA-F]+>(: )?|:? ?'<none>'|\[Errno -?\d+\] ")


def _short(exc: BaseException) -> str:
    text = _HANDLE_NOISE.sub("", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def named_audio_error(exc: ValueError, name: str) -> AudioError:
    """An AudioError whose message starts with ``name`` (decoders name bytes and arrays generically)."""
    msg = str(exc)
    for generic in ("bytes input", "array input"):
        if name.startswith(generic) and msg.startswith(generic) and not msg.startswith(name):
            msg = name + msg[len(generic):]
    return AudioError(msg if msg.startswith(name) else f"{name}: {msg}")


def checked_segments(segments: Iterator, name: str) -> Iterator:
    """Re-raise a decode error met halfway through a stream under the input's own name."""
    try:
        yield from segments
    except ValueError as exc:
        raise named_audio_error(exc, name) from exc
    except (OSError, RuntimeError) as exc:  # a decoder or the detector failing halfway through this input
        raise AudioError(f"{name}: {type(exc).__name__}: {exc}") from exc
