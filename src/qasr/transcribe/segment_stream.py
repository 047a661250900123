"""One input's segments, in time order, as soon as each one and every one before it are transcribed.

What ``ASR.transcribe_segments`` returns: the shape a faster-whisper user iterates (``for segment in
segments``), while the later segments of a long file are still being transcribed together in the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from qasr.results import Segment, Transcription


class TranscriptionFailed(RuntimeError):
    """The input could not be transcribed (it could not be decoded, or a request failed); the segments
    before the failure were already yielded. ``transcription`` holds the error."""

    def __init__(self, transcription: Transcription) -> None:
        super().__init__(transcription.error)
        self.transcription = transcription


class SegmentStream:
    """Iterate it for the input's ``Segment``s in time order. Once it is exhausted, ``transcription`` holds
    the whole ``Transcription`` (the same as ``transcribe`` gives: its segments are those yielded, and with
    word timestamps it drops every segment's words when some segment got none). Closing it early (or
    breaking out of a ``with`` block) cancels what is still being transcribed. A failed input raises
    ``TranscriptionFailed`` at the end."""

    def __init__(self, events: Iterator[tuple[int, object]]) -> None:
        self._events = events
        self.transcription: Transcription | None = None

    def __iter__(self) -> Iterator[Segment]:
        for _, item in self._events:
            if isinstance(item, Segment):
                yield item
            elif isinstance(item, Transcription):
                self.transcription = item
                if item.error is not None:
                    raise TranscriptionFailed(item)

    def close(self) -> None:
        self._events.close()  # type: ignore[attr-defined]

    def __enter__(self) -> SegmentStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
