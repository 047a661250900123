"""The pipeline's CPU stage: an input cut into segment rows by ``ASR.transcribe``'s own ``cut_input``;
a bad input gives an ``end`` row naming its error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qasr.audio.io import SAMPLE_RATE, checked_segments, named_audio_error
from qasr.distributed import rows
from qasr.distributed.inputs import is_uri, read_uri
from qasr.transcribe.options import TranscribeOptions
from qasr.transcribe.options import cut as cut_input


def display_name(source: str) -> str:
    """How results name an input: a path as ``transcribe`` names it, a URI as given."""
    return source if is_uri(source) else str(Path(source))


def location(source: str) -> str:
    """Where workers read an input: a URI as given, a path made absolute."""
    return source if is_uri(source) else os.path.abspath(source)


def segment_batch(batch: dict, options: TranscribeOptions) -> Iterator[dict[str, list]]:
    """``map_batches`` function: the rows of every input in ``batch``, one batch per segment so a long
    input streams on while it is decoded."""
    for item, given, source, skip in zip(batch["item"], batch["given"], batch["source"], batch["skip"], strict=True):
        done = set(json.loads(str(skip)))
        for r in input_rows(int(item), str(given), str(source), options, done):
            yield rows.batch([r])


def input_rows(item: int, given: str, source: str, options: TranscribeOptions,
               skip: set[int] | frozenset[int] = frozenset()) -> Iterator[dict]:
    """One input's segment rows (minus those numbered in ``skip``), then its ``end`` row. ``given``: the
    input as named by the caller; ``source``: where workers read it."""
    name = display_name(given)
    count = 0
    try:
        data: str | bytes = read_uri(source) if is_uri(source) else source
        cut = cut_input(data, options)
        if cut.wave is not None:
            duration = len(cut.wave) / SAMPLE_RATE
            if 0 not in skip:
                yield rows.row(item, name, rows.WHOLE, k=0, duration=duration, samples=_bytes(cut.wave))
            yield rows.row(item, name, rows.END, count=1, duration=duration)
            return
        stream = cut.segments
        assert stream is not None
        for seg in checked_segments(stream, name):
            if count not in skip:
                yield rows.row(item, name, rows.PIECE, k=count, offset=seg.start, duration=seg.end - seg.start,
                               samples=_bytes(seg.samples))
            count += 1
        yield rows.row(item, name, rows.END, count=count, duration=float(stream.duration or 0.0))
    except ValueError as exc:  # AudioError included; pyarrow's ArrowInvalid for a URI it cannot open
        yield rows.row(item, name, rows.END, error=str(named_audio_error(_renamed(exc, source, given), name)))
    except (OSError, RuntimeError) as exc:  # a decoder, a filesystem or the detector failing on this input
        yield rows.row(item, name, rows.END, error=f"{name}: {type(exc).__name__}: {_renamed(exc, source, given)}")


def _renamed(exc: Exception, source: str, given: str) -> ValueError:
    """The error naming the input as given, not by the path or "bytes input" the decoders saw."""
    message = str(exc).replace(source, given)
    if is_uri(given) and message.startswith("bytes input"):
        message = given + message[len("bytes input"):]
    return ValueError(message)


def _bytes(samples: np.ndarray) -> bytes:
    return np.ascontiguousarray(samples, dtype=np.float32).tobytes()
