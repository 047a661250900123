"""The rows that flow through the Ray Data pipeline, one dict of columns each (plain types: Arrow stores them).

Decode tasks emit, per input, its segments (``kind`` "piece": one engine request; "whole": the input
unsegmented, which ``make_pieces`` may still cut past ``max_chunk_sec``) and then one "end" row with the
segment count and the input's exact duration, or the error that stopped its decoding. ASR actors turn each
segment row into a "part" row (the segment's own Transcription, pickled), or a "failed" row when the
segment cannot become a request (too short to encode: its input fails as a decode error would), and pass
"end" rows through.
``k`` numbers an input's segments in time order, so the driver knows when it holds all of them, and a
retried input can skip the ones it already has.
"""

from __future__ import annotations

import numpy as np

PIECE, WHOLE, END, PART, FAILED = "piece", "whole", "end", "part", "failed"
COLUMNS = ("item", "source", "kind", "k", "offset", "duration", "samples", "count", "error", "part")


def row(item: int, source: str, kind: str, *, k: int = -1, offset: float = 0.0, duration: float = 0.0,
        samples: bytes = b"", count: int = 0, error: str = "", part: bytes = b"") -> dict:
    """A row with every column set (unused ones empty), so all batches share one schema."""
    return {"item": item, "source": source, "kind": kind, "k": k, "offset": offset, "duration": duration,
            "samples": samples, "count": count, "error": error, "part": part}


def batch(rows: list[dict]) -> dict[str, list]:
    """Rows as one batch (columns of lists) for ``map_batches`` to return."""
    return {name: [r[name] for r in rows] for name in COLUMNS}


def rows_of(batch: dict) -> list[dict]:
    """The rows of a batch as ``map_batches`` hands it over (numpy columns), with plain Python values."""
    names = [n for n in COLUMNS if n in batch]
    count = len(batch[names[0]]) if names else 0
    return [{n: _plain(batch[n][i]) for n in names} for i in range(count)]


def _plain(value: object) -> object:
    return value.item() if isinstance(value, np.generic) else value


def samples_of(data: bytes) -> np.ndarray:
    """16 kHz float32 samples back from a row's bytes (copied: the engine may keep them past the batch)."""
    return np.frombuffer(data, dtype=np.float32).copy()
