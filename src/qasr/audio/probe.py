"""An input's duration without decoding: for admission (the header's, else extrapolated from the first
packets; either can be wrong, so watch the decoding too) and for progress (the header's)."""

from __future__ import annotations

from dataclasses import dataclass

import av

from qasr.audio.decode_blocks import BlockDecoder
from qasr.audio.io import AudioError, EncodedAudio, checked_encoded

# Enough packets for a steady bitrate, little enough to read at once.
PROBE_BYTES = 1 << 20
# Opus's lowest bitrate (6 kbit/s): the bound when not even packets have times.
MIN_BYTES_PER_S = 750.0


@dataclass(frozen=True)
class Duration:
    seconds: float
    declared: bool  # False: an estimate


def header_duration(path: str) -> float | None:
    """A file's duration from its header, or None (unstated, or unreadable: the transcription says why)."""
    try:
        return BlockDecoder(lambda: path, path, block_s=1.0).duration
    except (AudioError, OSError):
        return None


def probe_duration(source: EncodedAudio) -> Duration:
    """The header's duration, else an estimate; AudioError when the input is empty or cannot be opened."""
    checked_encoded(source)
    decoder = BlockDecoder(source.opener, source.name, block_s=1.0)
    if decoder.duration is not None:
        return Duration(decoder.duration, declared=True)
    try:
        seconds = _demuxed_estimate(source)
    except Exception as exc:  # noqa: BLE001 - the decode itself will tell what is wrong, under the input's name
        raise AudioError(f"{source.name}: cannot be read as audio: {exc}") from exc
    return Duration(seconds if seconds is not None else source.size / MIN_BYTES_PER_S, declared=False)


def _demuxed_estimate(source: EncodedAudio) -> float | None:
    """Seconds extrapolated from the packets in the first PROBE_BYTES; None when they carry no times."""
    with av.open(source.opener(), mode="r") as container:
        track = container.streams.audio[0]
        first = end = None
        payload = 0
        complete = True
        for packet in container.demux(track):
            if packet.size == 0:  # the demuxer's final flush packet
                continue
            payload += packet.size
            if packet.pts is not None and packet.duration and packet.time_base is not None:
                start = float(packet.pts * packet.time_base)
                first = start if first is None else min(first, start)
                stop = start + float(packet.duration * packet.time_base)
                end = stop if end is None else max(end, stop)
            if payload >= PROBE_BYTES:
                complete = False
                break
        if first is None or end is None or payload == 0:
            return None
        seconds = end - first
        # container overhead makes this a slight over-estimate, the safe side for admission
        return seconds if complete else seconds * source.size / payload
