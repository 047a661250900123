"""The driver's side of the pipeline: gather each input's segments, in any order, once each, and
assemble its Transcription as on one machine.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from qasr.distributed import rows
from qasr.model.prompt import merge_languages
from qasr.results import Transcription, worst_finish_reason
from qasr.transcribe.text import join_segment_texts


@dataclass
class _Input:
    parts: dict[int, Transcription | None] = field(default_factory=dict)  # k -> the segment's result
    count: int | None = None  # segments, known from the "end" row
    duration: float = 0.0
    error: str | None = None  # the input failed: its result says so, with duration 0


class Collector:
    """Turns result rows into ``(item, Transcription)`` for inputs ``0..len(names)-1``."""

    def __init__(self, names: Sequence[str], words: bool, progress: Callable[[float], None] | None = None) -> None:
        self.names = list(names)
        self.words = words
        self.progress = progress
        self.inputs: dict[int, _Input] = {}
        self.finished: set[int] = set()
        self.segments = 0  # distinct segments received
        self.repeats = 0  # segments received again (a retried call), ignored

    def add(self, r: dict) -> tuple[int, Transcription] | None:
        """Take one row; the input's result when this row completed it."""
        i, kind = int(r["item"]), r["kind"]
        if i in self.finished:
            self.repeats += kind != rows.END  # a later pass sends end rows again
            return None
        st = self.inputs.setdefault(i, _Input())
        if kind == rows.END:
            if st.count is not None:
                return None
            if r["error"]:
                st.error = r["error"]
            else:
                st.count, st.duration = int(r["count"]), float(r["duration"])
        elif kind in (rows.PART, rows.FAILED):
            k = int(r["k"])
            if k in st.parts:
                self.repeats += 1
                return None
            self.segments += 1
            if kind == rows.FAILED:
                st.parts[k] = None
                st.error = st.error or r["error"]
            else:
                st.parts[k] = pickle.loads(r["part"])
                if self.progress is not None:
                    self.progress(float(r["duration"]))
        else:
            raise ValueError(f"unexpected row kind {kind!r}")
        return self._finish(i, st)

    def _finish(self, i: int, st: _Input) -> tuple[int, Transcription] | None:
        if st.error is not None:
            result = Transcription("", "", 0.0, error=st.error, source=self.names[i])
        elif st.count is not None and all(k in st.parts for k in range(st.count)):
            parts = [st.parts[k] for k in range(st.count)]
            result = merge_parts(parts, source=self.names[i], duration=st.duration, words=self.words)  # type: ignore[arg-type]
        else:
            return None
        self.finished.add(i)
        del self.inputs[i]
        return i, result

    def incomplete(self) -> dict[int, set[int]]:
        """Unfinished inputs, each with the segments already held (a retry skips those)."""
        return {i: set(self.inputs[i].parts) if i in self.inputs else set()
                for i in range(len(self.names)) if i not in self.finished}


def merge_parts(parts: list[Transcription], *, source: str, duration: float, words: bool) -> Transcription:
    """One input's Transcription from its segments' own, in time order, as on one machine."""
    for part in parts:
        if part.error is not None:
            return Transcription("", "", duration, error=part.error, source=source)
    segments = [s for part in parts for s in part.segments]
    worst = worst_finish_reason(s.finish_reason for s in segments)
    # word times only when every segment with text has them
    all_timed = words and all(s.words for s in segments if s.text)
    if words and not all_timed:
        segments = [replace(s, words=()) for s in segments]
    return Transcription(text=join_segment_texts(s.text for s in segments),
                         language=merge_languages([p.language for p in parts]), duration=round(duration, 3),
                         raw="".join(p.raw for p in parts), token_ids=tuple(t for p in parts for t in p.token_ids),
                         segments=tuple(segments), source=source, finish_reason=worst,
                         timestamps="word" if all_timed else "segment")
