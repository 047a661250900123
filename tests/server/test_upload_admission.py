"""The parts of admission before decoding, without HTTP: the duration probe on real encoded files, and an
upload's admission against the real queue budget (growing an estimate, refusing a header that understates,
a client that leaves). The whole path over HTTP is in test_admission.py."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import pytest

from qasr.audio.io import AudioError, EncodedAudio
from qasr.audio.probe import Duration, probe_duration
from qasr.server.errors import ApiError
from qasr.server.limits import AudioBudget, UploadAdmission

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg makes the test audio")


def encoded(data: bytes, name: str = "up") -> EncodedAudio:
    return EncodedAudio(name, lambda: io.BytesIO(data), len(data))


def tone(tmp_path: Path, fmt: str, seconds: float, pipe: bool = False) -> bytes:
    """``seconds`` of a tone in ``fmt``; ``pipe``: written to a pipe, so the muxer cannot go back to write
    the duration into the header."""
    args = ["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", f"sine=f=300:d={seconds}", "-ac", "1"]
    if fmt in ("webm", "ogg"):
        args += ["-c:a", "libopus", "-b:a", "16k"]
    if pipe:
        return subprocess.run([*args, "-f", fmt, "pipe:1"], capture_output=True, check=True).stdout
    out = tmp_path / f"tone.{fmt}"
    subprocess.run([*args, "-y", str(out)], check=True)
    return out.read_bytes()


def test_the_probe_reads_headers_and_estimates_the_rest(tmp_path: Path) -> None:
    for fmt in ("wav", "flac", "mp3", "ogg"):
        assert probe_duration(encoded(tone(tmp_path, fmt, 5))) == Duration(pytest.approx(5.0, abs=0.03), True)
    # no duration in a piped WebM's header: its packets, demuxed (not decoded), give the figure
    piped = probe_duration(encoded(tone(tmp_path, "webm", 5, pipe=True)))
    assert not piped.declared and piped.seconds == pytest.approx(5.0, abs=0.05)
    with pytest.raises(AudioError, match="^up: the file is empty"):
        probe_duration(encoded(b""))
    with pytest.raises(AudioError, match="^up: cannot be decoded as audio"):
        probe_duration(encoded(b"not audio " * 300))


def test_an_upload_is_admitted_by_its_probe_and_held_to_it() -> None:
    budget = AudioBudget(max_queued_s=100)
    first = UploadAdmission(budget, Duration(30.0, declared=True), "a.wav")
    assert budget.queued_s == 30
    with pytest.raises(ApiError) as refused:  # 30 + 80 > 100: refused before decoding
        UploadAdmission(budget, Duration(80.0, declared=True), "b.wav")
    assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
    first.watch(30.0 * 1.02 + 2.0)  # a container's rounding is slack, not a lie
    with pytest.raises(AudioError, match="a.wav: decodes to more audio than its header states"):
        first.watch(33.0)
    assert first.refusal is not None and first.refusal.status == 413 and first.refusal.code == "audio_too_long"
    first.ticket.release(transcribed=False)
    assert budget.queued_s == 0


def test_an_estimate_grows_while_the_queue_has_room_then_gets_429() -> None:
    budget = AudioBudget(max_queued_s=100)
    alone = UploadAdmission(budget, Duration(10.0, declared=False), "rec.webm")
    alone.watch(500.0)  # alone in the queue: it grows past the limit, as one long file is admitted
    assert alone.refusal is None and budget.queued_s == alone.ticket.seconds >= 500
    alone.ticket.resize(520.0)  # decoded: it holds what it really is
    assert budget.queued_s == 520
    alone.ticket.release(transcribed=True)
    other = UploadAdmission(budget, Duration(50.0, declared=True), "other.wav")
    estimated = UploadAdmission(budget, Duration(10.0, declared=False), "rec.webm")
    estimated.watch(30.0)  # 50 + 30 * 1.25 fits
    with pytest.raises(AudioError, match="rec.webm: the server's queue is full"):
        estimated.watch(60.0)  # 50 + 75 does not
    assert estimated.refusal is not None and estimated.refusal.status == 429
    for admission in (other, estimated):
        admission.ticket.release(transcribed=False)
    assert budget.queued_s == 0


def test_a_client_that_leaves_stops_the_decoding() -> None:
    admission = UploadAdmission(AudioBudget(100), Duration(60.0, declared=True), "a.wav")
    admission.watch(10.0)
    admission.leave()
    with pytest.raises(AudioError, match="client went away"):
        admission.watch(11.0)
    assert admission.refusal is None

