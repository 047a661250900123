"""The rows of the Ray Data pipeline: an input's segments (``piece``, ``whole``), then its ``end`` row;
actors make ``part`` (a pickled Transcription) or ``failed`` rows. ``k`` numbers segments in time order.
"""

from __future__ import annotations

import numpy as np

PIECE, WHOLE, END, PART, FAILED = "piece", "whole", "end", "part", "failed"
COLUMNS = ("item", "source", "kind", "k", "offset", "duration", "samples", "count", "error", "part")


def row(item: int, source: str, kind: str, *, k: int = -1, offset: float = 0.0, duration: float = 0.0,
        samples: bytes = b"", count: int = 0, error: str = "", part: bytes = b"") -> dict:
    """A row with every column set, so all batches share one schema."""
    return {"item": item, "source": source, "kind": kind, "k": k, "offset": offset, "duration": duration,
            "samples": samples, "count": count, "error": error, "part": part}


def batch(rows: list[dict]) -> dict[str, list]:
    """Rows as one batch (columns of lists), as ``map_batches`` returns it."""
    return {name: [r[name] for r in rows] for name in COLUMNS}


def rows_of(batch: dict) -> list[dict]:
    """The rows of a batch as ``map_batches`` hands it over, with plain Python values."""
    names = [n for n in COLUMNS if n in batch]
    count = len(batch[names[0]]) if names else 0
    return [{n: _plain(batch[n][i]) for n in names} for i in range(count)]


def _plain(value: object) -> object:
    return value.item() if isinstance(value, np.generic) else value


def samples_of(data: bytes) -> np.ndarray:
    """16 kHz float32 samples from a row's bytes (a copy: the engine may keep them)."""
    return np.frombuffer(data, dtype=np.float32).copy()
