"""How long an encoded input is, told without decoding a sample: what admission control looks at.

The container's header usually says (libsndfile's frame count; FFmpeg's stream or container duration). When
it does not (a WebM a browser recorded, an Ogg stream written to a pipe), the first ``PROBE_BYTES`` of
packets are demuxed, not decoded, and their seconds per byte extrapolated to the whole input. Either
figure can be wrong (a header can lie, a bitrate can change), so whoever admits by it must also watch the
decoding (:class:`qasr.audio.io.EncodedAudio`'s ``watch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import av

from qasr.audio.decode_blocks import BlockDecoder
from qasr.audio.io import AudioError, EncodedAudio, checked_encoded

# Enough packets for a steady bitrate (about 4 minutes of 32 kbit/s Opus), little enough to read at once.
PROBE_BYTES = 1 << 20
# The lowest bitrate a speech codec runs at (Opus's 6 kbit/s): the bound when not even packets have times.
MIN_BYTES_PER_S = 750.0


@dataclass(frozen=True)
class Duration:
    seconds: float
    declared: bool  # True: the header states it; False: an estimate (bounded demux, else a bound by bytes)


def probe_duration(source: EncodedAudio) -> Duration:
    """The input's duration from its header, else an estimate; AudioError naming it when it is empty or
    neither decoder can open it (so a bad upload is refused before anything is admitted)."""
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
    """Seconds of audio, extrapolated from the packets in the first PROBE_BYTES (exact when the whole input
    fits); None when its packets carry no times."""
    with av.open(source.opener(), mode="r") as container:
        stream = container.streams.audio[0]
        first = end = None
        payload = 0
        complete = True
        for packet in container.demux(stream):
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
        # the whole file's bytes against the packets' payload: container overhead makes this a slight
        # over-estimate, the safe side for admission
        return seconds if complete else seconds * source.size / payload
