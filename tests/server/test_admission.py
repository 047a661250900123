"""Admission before decoding, over real HTTP against a real ``qasr serve``: an upload is admitted or refused
(429) by the duration its header states, before a sample is decoded; one whose header lies is stopped once
its decoded audio passes what was admitted (413); the queue's audio is released on every path; the server's
peak memory stays bounded under parallel hour-long uploads; messages name the upload, never a repr.

The long inputs are Opus tones (no speech: the admitted ones cost decoding, not transcription), made once
with ffmpeg by looping a one-minute encoding (encoding an hour would take minutes)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_proc import DEMO_MODEL, ServerProcess, metric

from qasr.testing.speech import speak

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg makes the test audio")

QUEUE_LIMIT_S = 60
PARALLEL = 8


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args], check=True)


def with_declared_duration(mka: bytes, seconds: float) -> bytes:
    """A Matroska file whose header states ``seconds`` (the Segment Info Duration, a double in ms), whatever
    its packets hold. Written without CRC-32 elements, so the patched file is still well-formed."""
    at = mka.find(b"\x44\x89\x88")  # element id 0x4489, size 8
    assert at > 0, "no 8-byte Duration element"
    return mka[:at + 3] + struct.pack(">d", seconds * 1000) + mka[at + 11:]


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("admission_audio")
    minute = d / "minute.opus"
    ffmpeg("-f", "lavfi", "-i", "sine=f=300:d=60", "-ac", "1", "-c:a", "libopus", "-b:a", "6k", str(minute))
    hour = d / "hour.opus"  # about 2.6 MB: 16 kHz float32 would be 230 MB, FFmpeg's 48 kHz output 690 MB
    ffmpeg("-stream_loop", "59", "-i", str(minute), "-c", "copy", str(hour))
    mka = d / "minute.mka"
    ffmpeg("-i", str(minute), "-c", "copy", "-write_crc32", "0", str(mka))
    short_header = d / "says_10s.mka"  # 60 s of audio under a header that says 10 s
    short_header.write_bytes(with_declared_duration(mka.read_bytes(), 10.0))
    long_header = d / "says_1h.mka"  # 60 s of audio under a header that says an hour
    long_header.write_bytes(with_declared_duration(mka.read_bytes(), 3600.0))
    webm = d / "no_duration.webm"  # written to a pipe: no duration in the header, admitted by a probe
    with open(webm, "wb") as out:
        subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(minute), "-c", "copy", "-f", "webm", "pipe:1"],
                       stdout=out, check=True)
    return {"hour": hour, "short_header": short_header, "long_header": long_header, "webm": webm,
            "speech": speak("set an alarm for six forty five", d / "speech.wav")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("admission") / "serve.log", "--max-queue-audio-s",
                       str(QUEUE_LIMIT_S)) as srv:
        yield srv


def post(server: ServerProcess, name: str, data: bytes, timeout: float | httpx.Timeout = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": (name, data)}, timeout=timeout)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def queued_s(server: ServerProcess) -> float:
    return metric(httpx.get(f"{server.url}/metrics").text, "qasr_queued_audio_seconds")


def wait_queue_empty(server: ServerProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while queued_s(server) != 0:
        assert time.monotonic() < deadline, f"the queue still holds {queued_s(server)} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_parallel_hour_long_uploads_are_refused_before_decoding(server, audio) -> None:
    """8 hour-long uploads at once against a 60 s queue: one is admitted into the empty queue, the others get
    429 within moments (the old server decoded each first: 9-12 s, and gigabytes), the server's peak memory
    barely moves, and an upload whose header claims an hour gets 429 although it holds a minute (the
    decision is the header's, not the decoded audio's). The admitted one's client then gives up: its
    decoding stops and the queue empties."""
    assert post(server, "speech.wav", audio["speech"].read_bytes()).status_code == 200  # warm: decoders loaded
    before_mb = peak_rss_mb(server.proc.pid)
    hour = audio["hour"].read_bytes()

    def one(_: int) -> tuple[float, httpx.Response | None]:
        start = time.monotonic()
        try:
            r = post(server, "hour.opus", hour, timeout=httpx.Timeout(60, read=8))
        except httpx.ReadTimeout:  # the admitted one: an hour of audio is still being decoded
            return time.monotonic() - start, None
        return time.monotonic() - start, r

    with ThreadPoolExecutor(PARALLEL) as pool:
        answers = [pool.submit(one, k) for k in range(PARALLEL)]
        refused = []
        for fut in answers:
            if fut.result()[1] is not None:
                refused.append(fut.result())
        admitted = PARALLEL - len(refused)
    assert admitted == 1, [r.text for _, r in refused]
    for seconds, r in refused:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
        assert seconds < 6.0, f"a 429 took {seconds:.1f} s: was the upload decoded first?"
    peak_mb = peak_rss_mb(server.proc.pid)
    # the admitted hour decodes block by block; the refused ones were never decoded at all
    assert peak_mb - before_mb < 250, f"peak RSS grew {peak_mb - before_mb:.0f} MiB (from {before_mb:.0f})"
    wait_queue_empty(server)  # the admitted upload's client left: its decoding stopped, its share released
    assert post(server, "speech.wav", audio["speech"].read_bytes()).json()["text"] == \
        "set an alarm for six forty five"


@pytest.mark.slow
def test_a_header_that_claims_an_hour_is_refused_by_its_header(server, audio) -> None:
    """While the queue holds audio, a file whose header says an hour gets 429 although it holds a minute: the
    server decided by the header, before decoding (decoding would have found 60 s, which fits)."""
    hour = audio["hour"].read_bytes()
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, server, "hour.opus", hour, httpx.Timeout(60, read=5))
        deadline = time.monotonic() + 10
        while queued_s(server) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = post(server, "says_1h.mka", audio["long_header"].read_bytes())
        assert r.status_code == 429, r.text
        with pytest.raises(httpx.ReadTimeout):
            holder.result()
    wait_queue_empty(server)
    r = post(server, "says_1h.mka", audio["long_header"].read_bytes())  # into an empty queue: admitted
    assert r.status_code == 200 and r.json()["text"] == ""  # a tone: no speech
    assert queued_s(server) == 0


def test_a_header_that_understates_is_stopped_at_what_was_admitted(server, audio) -> None:
    """60 s of audio under a header saying 10 s: decoding stops once it passes 10 s (plus slack) with 413."""
    start = time.monotonic()
    r = post(server, "says_10s.mka", audio["short_header"].read_bytes())
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "audio_too_long" and error["param"] == "file"
    assert error["message"].startswith("says_10s.mka: decodes to more audio than its header states (10.0 s")
    assert time.monotonic() - start < 10
    assert queued_s(server) == 0  # released on the error path


def test_an_upload_without_a_duration_is_admitted_by_a_probe(server, audio) -> None:
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": ("rec.webm", audio["webm"].read_bytes())},
                   data={"response_format": "verbose_json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["duration"] == pytest.approx(60.0, abs=0.1)
    assert queued_s(server) == 0


def test_errors_name_the_upload_never_a_repr(server, audio) -> None:
    for name, data in (("junk.mp3", b"this is not audio at all " * 200), ("notes.txt", b"hello")):
        r = post(server, name, data)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{name}: cannot be decoded as audio"), message
        assert "object at 0x" not in message and "<none>" not in message and "Errno" not in message
        assert "None" not in message  # PyAV names a spooled upload's handle 'None'
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename=""\r\n\r\n' + b"garbage" * 100
            + b"\r\n--b--\r\n")  # a file part without a name
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", content=body, timeout=60,
                   headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the upload: cannot be decoded"), r.text
    assert "None" not in r.json()["error"]["message"], r.text


def test_empty_file_is_described_alike_by_the_cli_and_the_server(server, tmp_path) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    r = post(server, "empty.wav", b"")
    assert r.status_code == 400 and r.json()["error"]["message"] == "empty.wav: the file is empty (0 bytes)"
    cli = subprocess.run([sys.executable, "-m", "qasr", "transcribe", "empty.wav", "-m", str(DEMO_MODEL),
                          "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode != 0
    assert "empty.wav: the file is empty (0 bytes)" in cli.stderr, cli.stderr
