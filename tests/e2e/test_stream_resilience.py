"""``qasr stream`` and live sessions when things are not tidy, through the real CLI and a real ``qasr serve``
(demo model) on 127.0.0.1: a long silence mid-stream, a file sent as fast as the server takes it (flow
control, never a dropped append), a file that is not audio, a language the model lacks, a server that
stops answering, the first Ctrl-C on a microphone, and a server's SIGTERM drain with live sessions that
keep sending (bounded by ``--drain-timeout``, which also cuts an HTTP request that never finishes)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jiwer
import numpy as np
import pytest
import soundfile as sf
import websockets
from server_proc import ROOT, ServerProcess, metric

from qasr.testing.speech import speak

SENTENCES = ("set an alarm for six forty five", "turn off the lights in the bedroom",
             "what is the weather like in paris on friday", "call anna on the ninth of july", "play some music")
BACKLOG_S = 4  # small, so that a file sent at --speed 0 meets the flow control many times
IDLE_S = 3  # the server closes a session that sends nothing this long: a silent *sending* client is not idle
SR = 16000

pytestmark = pytest.mark.slow  # whole-product runs of qasr stream against a real server (make test-slow)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(SR * seconds), np.float32)


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> dict[str, Path]:
    from qasr.audio.io import load_audio

    d = tmp_path_factory.mktemp("resilience")
    waves = [load_audio(speak(s, d / f"s{k}.wav")) for k, s in enumerate(SENTENCES)]
    files = {f"s{k}": d / f"s{k}.wav" for k in range(len(SENTENCES))}
    # two sentences 90 s apart: the stream carries only silence (no transcript event) for 90 s of audio
    sf.write(d / "gap.wav", np.concatenate([silence(0.5), waves[0], silence(90), waves[1], silence(1)]), SR)
    # 60 s: five sentences, the rest silence (cheap to transcribe: the VAD lets it go undecoded)
    parts = [p for w in waves for p in (w, silence(12 - len(w) / SR))]
    sf.write(d / "s60.wav", np.concatenate(parts), SR)
    (d / "empty.wav").write_bytes(b"")
    (d / "notes.wav").write_text("these are notes, not audio\n")
    return {**files, "gap": d / "gap.wav", "s60": d / "s60.wav", "empty": d / "empty.wav",
            "notes": d / "notes.wav"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("resilience_server") / "serve.log", "--live-max-backlog-s",
                      str(BACKLOG_S), "--live-idle-timeout-s", str(IDLE_S)) as srv:
        yield srv


def qasr_stream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qasr", "stream", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def finals(stdout: str) -> list[str]:
    return [line.split("] ", 1)[1] for line in stdout.strip().splitlines()]


def test_a_long_silence_mid_stream_keeps_every_sentence(server, audio) -> None:
    """90 s of silence at 8x: 11 s in which the server sends no transcript event, eleven times the client's
    keepalive (the old client gave up after a fixed time without a message), while the server's idle
    timeout (3 s) does not count a client that sends silence."""
    started = time.monotonic()
    done = qasr_stream(str(audio["gap"]), "--server", server.url, "--speed", "8", "--keepalive", "1")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert finals(done.stdout) == list(SENTENCES[:2]), done.stdout
    assert took >= 92 / 8  # really played at 8x: the silence took its time
    print(f"92 s with a 90 s silence at 8x in {took:.1f} s")


@pytest.mark.parametrize("protocol", ["native", "openai"])
def test_speed_0_waits_on_the_backlog_and_drops_nothing(server, audio, protocol) -> None:
    started = time.monotonic()
    done = qasr_stream(str(audio["s60"]), "--server", server.url, "--protocol", protocol, "--speed", "0", "--json")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "backlog" not in done.stderr and "overflow" not in done.stderr and "error" not in done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert not [e for e in events if e["event"] == "servererror"]
    got = [e for e in events if e["event"] == "final"]
    assert len(got) == len(SENTENCES), got  # every sentence, the last ones too (a dropped append loses them)
    assert jiwer.wer(" ".join(SENTENCES), " ".join(e["text"] for e in got)) <= 0.1, got
    assert got[-1]["start"] > 47  # the last sentence starts at 48 s (less the pre-roll): all 60 s arrived
    print(f"{protocol}: 60 s at --speed 0 with a {BACKLOG_S} s backlog in {took:.1f} s")


def test_a_file_that_is_not_audio_fails_at_once(server, audio) -> None:
    for name, says in (("empty", "empty"), ("notes", "cannot be decoded")):
        started = time.monotonic()
        done = qasr_stream(str(audio[name]), "--server", server.url, timeout=60)
        took = time.monotonic() - started
        assert done.returncode == 2 and says in done.stderr and str(audio[name]) in done.stderr, done.stderr
        assert "Timeout" not in done.stderr and "session_idle" not in done.stderr
        assert took < 20, took  # the interpreter's start; no session was opened and waited on


def test_a_language_the_model_lacks_is_a_bad_request(server, audio) -> None:
    done = qasr_stream(str(audio["s0"]), "--server", server.url, "--language", "fr", timeout=60)
    assert done.returncode == 1 and "unsupported_language" in done.stderr, done.stderr
    done = qasr_stream(str(audio["s0"]), "--server", server.url, "--language", "fr", "--protocol", "openai", timeout=60)
    assert done.returncode == 1 and "unsupported_language" in done.stderr, done.stderr

    async def native() -> tuple[dict, int | None]:
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/stream") as ws:
            await ws.send(json.dumps({"type": "start", "language": "fr"}))
            event = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            return event, ws.close_code

    event, code = asyncio.run(native())
    assert event["code"] == "unsupported_language" and "fr" in event["message"]
    assert code == 4400  # a bad request: 1008 is the bad key's alone


def mic(source: Path, server: ServerProcess, *extra: str) -> subprocess.Popen:
    """``qasr stream mic`` with ffmpeg's lavfi as the microphone: the file in real time, then silence
    without end (an endless source)."""
    return subprocess.Popen([sys.executable, "-m", "qasr", "stream", "mic", "--mic-format", "lavfi", "--mic-device",
                             f"amovie={source},apad,arealtime", "--server", server.url, "--json", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, want: str, timeout: float) -> list[dict]:
    """The JSON events ``proc`` prints, up to the first partial whose text contains ``want``."""
    assert proc.stdout is not None
    events: list[dict] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "partial" and want in events[-1]["stable"] + events[-1]["unstable"]:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"no partial with {want!r}: {events}"
    return events


def test_mic_first_ctrl_c_ends_capture_with_the_final_transcript(server, audio) -> None:
    proc = mic(audio["s0"], server, "--no-turn-detection")  # one turn: only the end of the input ends it
    try:
        read_until(proc, "five", 60)  # the whole sentence was heard; the capture goes on (silence)
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - interrupted
    finally:
        proc.kill()
    events = [json.loads(line) for line in out.splitlines()]
    got = [e["text"] for e in events if e["event"] == "final"]
    assert proc.returncode == 130, err
    assert len(got) == 1 and jiwer.wer(SENTENCES[0], got[0]) <= 0.2, (got, err)
    assert "waiting for the last transcript" in err and "Traceback" not in err
    print(f"mic: first Ctrl-C to exit with the final transcript: {took:.2f} s")


def test_a_server_that_stops_answering_pings_is_gone(server, audio) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "qasr", "stream", str(audio["s60"]), "--server", server.url,
                             "--keepalive", "1", "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        read_until(proc, "", 60)
        server.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent: only the pings can tell
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - stopped
    finally:
        server.proc.send_signal(signal.SIGCONT)
        proc.kill()
    assert proc.returncode == 1 and "connection to the server was lost" in err, err
    assert took < 6, took  # one keepalive interval plus one ping timeout, and the interpreter's exit


async def endless_native(url: str, wave: np.ndarray, sigterm: asyncio.Event, after_sigterm_s: list[float]) -> tuple:
    """A native session that sends ``wave`` and then silence in real time (100 ms every 100 ms), as a
    microphone does, without end; returns the messages it got, the close code, and when it closed."""
    async with websockets.connect(url.replace("http", "ws") + "/v1/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "turn_detection": False}))
        messages = [json.loads(await ws.recv())]

        async def send() -> None:
            data = (np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes()
            step = SR // 10 * 2  # 100 ms
            k = 0
            while True:
                piece = data[k * step:(k + 1) * step] or bytes(step)
                k += 1
                try:
                    await ws.send(piece)
                except websockets.ConnectionClosed:
                    return
                if sigterm.is_set():
                    after_sigterm_s.append(len(piece) / 2 / SR)
                await asyncio.sleep(0.1)

        sender = asyncio.create_task(send())
        async for m in ws:
            messages.append(json.loads(m))
        closed = time.monotonic()
        sender.cancel()
        return messages, ws.close_code, closed


def test_sigterm_ends_live_sessions_that_keep_sending(tmp_path: Path, audio) -> None:
    from qasr.audio.io import load_audio

    drain_s = 20
    srv = ServerProcess(tmp_path / "serve.log", "--drain-timeout", str(drain_s))
    cli = None
    try:
        srv.wait_ready()
        cli = mic(audio["s1"], srv)  # turns cut at pauses: its sentence is a turn, then silence follows
        read_until(cli, "lights", 60)

        async def run() -> tuple:
            sigterm = asyncio.Event()
            sent_after: list[float] = []
            session = asyncio.create_task(endless_native(srv.url, load_audio(audio["s0"]), sigterm, sent_after))
            while metric(httpx.get(f"{srv.url}/metrics").text, "qasr_live_sessions") < 2:
                await asyncio.sleep(0.1)
            await asyncio.sleep(4)  # the sentence (2.6 s) went out: the turn holds it, and silence follows
            srv.proc.send_signal(signal.SIGTERM)
            sigterm.set()
            at = time.monotonic()
            messages, code, closed = await session
            return messages, code, closed - at, at, sum(sent_after)

        messages, code, to_close, at, sent_after = asyncio.run(run())
        exit_code = srv.proc.wait(drain_s + 10)
        to_exit = time.monotonic() - at
        cli_out, cli_err = cli.communicate(timeout=30)
    finally:
        if cli is not None:
            cli.kill()
        srv.stop()
    texts = [m["text"] for m in messages if m["type"] == "final"]
    assert len(texts) == 1 and jiwer.wer(SENTENCES[0], texts[0]) <= 0.2, messages[-3:]
    assert messages[-1]["type"] == "error" and messages[-1]["code"] == "shutting_down"
    assert code == 1001 and exit_code == 0
    assert sent_after > 0  # the client was still sending when the server began to drain
    assert to_close < drain_s and to_exit < drain_s + 5, (to_close, to_exit)
    cli_events = [json.loads(line) for line in cli_out.splitlines()]
    cli_finals = [e["text"] for e in cli_events if e["event"] == "final"]
    assert len(cli_finals) == 1 and jiwer.wer(SENTENCES[1], cli_finals[0]) <= 0.2, cli_events
    assert cli.returncode == 1 and "shutting_down" in cli_err, cli_err
    print(f"SIGTERM with 2 live sessions sending: closed (1001) after {to_close:.2f} s, server exited after "
          f"{to_exit:.2f} s")


async def long_turn(url: str, pcm: bytes, started: threading.Event) -> tuple[list[dict], int | None, float]:
    """A native session handed ``pcm`` as fast as the server takes it, one turn: far more work than a
    2 s drain allows. Returns its messages, the close code and when it closed."""
    async with websockets.connect(url.replace("http", "ws") + "/v1/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "turn_detection": False}))
        messages = [json.loads(await ws.recv())]
        for i in range(0, len(pcm), SR * 2 * 10):
            await ws.send(pcm[i:i + SR * 2 * 10])
        async for m in ws:
            messages.append(json.loads(m))
            if messages[-1]["type"] == "partial":
                started.set()
        return messages, ws.close_code, time.monotonic()


def test_drain_timeout_cuts_what_never_finishes(tmp_path: Path, audio) -> None:
    """An upload that trickles in without end would hold the drain forever, and a live session with up to 30 s
    of speech waiting takes longer than the drain allows: --drain-timeout 2 answers the upload 503 and ends the
    session with ``shutting_down`` (1001) at the deadline, and the server exits 1."""
    from qasr.audio.io import load_audio

    speech = np.concatenate([load_audio(audio[f"s{k % 5}"]) for k in range(48)])[: 120 * SR]
    # quarter-second steps: four times the work per second of audio, so the 30 s the server lets a session
    # queue stay far beyond a 2 s drain on a fast machine too (live steps go before all other work)
    srv = ServerProcess(tmp_path / "serve.log", "--drain-timeout", "2", "--live-chunk-s", "0.25")
    try:
        srv.wait_ready()
        working = threading.Event()
        session: list[tuple] = []
        pcm = (np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()
        live = threading.Thread(target=lambda: session.append(asyncio.run(long_turn(srv.url, pcm, working))))
        live.start()
        assert working.wait(60)
        sock = socket.create_connection(("127.0.0.1", srv.port))
        head = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n"
                b"Content-Type: multipart/form-data; boundary=xx\r\n\r\n--xx\r\nContent-Disposition: form-data; "
                b'name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n')
        sock.sendall(head)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    sock.sendall(b"\0" * 16)
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        deadline = time.monotonic() + 30
        while metric(httpx.get(f"{srv.url}/metrics").text, "qasr_requests_in_flight") < 2:  # it and /metrics
            assert time.monotonic() < deadline
            time.sleep(0.1)
        srv.proc.send_signal(signal.SIGTERM)
        at = time.monotonic()
        sock.settimeout(30)
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        answered = time.monotonic() - at
        stop.set()
        exit_code = srv.proc.wait(30)
        exited = time.monotonic() - at
        sock.close()
        live.join(30)
        log = srv.log()
    finally:
        srv.stop()
    status, _, rest = answer.decode(errors="replace").partition("\r\n")
    assert status.split()[1] == "503", answer
    body = json.loads(rest.split("\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "shutting_down" and "drain timeout" in body["error"]["message"]
    assert 1.5 < answered < 6, answered
    messages, code, closed = session[0]
    assert messages[-1]["type"] == "error" and messages[-1]["code"] == "shutting_down", messages[-3:]
    assert "drain timeout" in messages[-1]["message"] and code == 1001
    assert 1.5 < closed - at < 6, closed - at
    assert exit_code == 1 and exited < 12, exited
    assert "drain timeout" in log and "Traceback" not in log
    print(f"drain timeout 2 s: the stuck upload answered 503 after {answered:.2f} s, the long session closed "
          f"after {closed - at:.2f} s, exit 1 after {exited:.2f} s")
