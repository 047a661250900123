"""Every way out of a live session frees it: a real ``qasr serve`` (demo model) on 127.0.0.1, both live
protocols, clients that send faster than real time and leave while their backlog is full (dropped or
closed), go idle, or meet a drain; a fast sender stays connected under a tight client keepalive; the
session count and the KV blocks in use come back to zero. The runner and channel paths a real client
cannot reach reliably (a send that fails or never finishes) are driven in-process."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from server_proc import ServerProcess, metric

from qasr.testing.speech import speak

pytestmark = pytest.mark.slow  # real servers and misbehaving clients, each exit path (make test-slow)

BACKLOG_S = 4
IDLE_S = 2
MAX_SESSIONS = 12
FREED_S = 10  # a session's place and KV come back within this
PROTOCOLS = ["realtime", "stream"]


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """A few seconds of speech and a pause, 16 kHz float32."""
    from qasr.audio.io import load_audio

    path = speak("set an alarm for six forty five and turn off the lights in the bedroom",
                 tmp_path_factory.mktemp("leak_audio") / "s.wav")
    return np.concatenate([load_audio(path), np.zeros(8000, np.float32)])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("leak_server") / "serve.log", "--live-max-backlog-s", str(BACKLOG_S),
                       "--live-idle-timeout-s", str(IDLE_S), "--max-live-sessions", str(MAX_SESSIONS)) as srv:
        yield srv


def pcm16(speech: np.ndarray, seconds: float) -> bytes:
    """``seconds`` of the speech clip, repeated, as 16 kHz PCM16."""
    wave = np.tile(speech, int(seconds * 16000 / speech.size) + 1)[:int(seconds * 16000)]
    return (np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes()


class Refused(Exception):
    pass


class Client:
    """One live session over either protocol, at 16 kHz PCM16."""

    def __init__(self, ws, protocol: str) -> None:  # noqa: ANN001
        self.ws = ws
        self.protocol = protocol
        self.events: list[dict] = []

    @classmethod
    async def open(cls, server: ServerProcess, protocol: str, **kwargs) -> Client:  # noqa: ANN003
        base = server.url.replace("http://", "ws://")
        path = "/v1/realtime?intent=transcription" if protocol == "realtime" else "/v1/stream"
        client = cls(await websockets.connect(base + path, max_size=None, **kwargs), protocol)
        if protocol == "realtime":
            client.refused_unless(await client.next(), "session.created")
            await client.ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
        else:
            await client.ws.send(json.dumps({"type": "start"}))
            client.refused_unless(await client.next(), "ready")
        return client

    def refused_unless(self, event: dict, kind: str) -> None:
        if event["type"] != kind:
            self.ws.transport.abort()
            raise Refused(event)

    async def next(self, timeout: float = 60) -> dict:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.events.append(event)
        return event

    async def send_audio(self, data: bytes, step: int = 32000, pace_s: float = 0.0) -> None:
        """``data`` in ``step``-byte messages, as fast as the socket takes them or one per ``pace_s``."""
        for i in range(0, len(data), step):
            piece = data[i:i + step]
            if self.protocol == "realtime":
                await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(piece).decode()}))
            else:
                await self.ws.send(piece)
            if pace_s:
                await asyncio.sleep(pace_s)

    async def end(self) -> None:
        await self.ws.send(json.dumps({"type": "input_audio_buffer.commit" if self.protocol == "realtime"
                                       else "end"}))

    @staticmethod
    def backlog_s(event: dict) -> float | None:
        if event["type"] == "input_audio_buffer.progress":
            return event["backlog_ms"] / 1000
        if event["type"] == "progress":
            return event["backlog_seconds"]
        return None

    async def until_backlog_full(self) -> None:
        """Read events until one says the backlog is (nearly) full."""
        while (b := self.backlog_s(await self.next())) is None or b < BACKLOG_S - 1.5:
            pass

    def drop(self) -> None:
        self.ws.transport.abort()  # no close frame: the connection just drops


def live_metrics(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return metric(text, "qasr_live_sessions"), metric(text, "qasr_engine_kv_blocks_used")


def wait_freed(server: ServerProcess, within: float = FREED_S) -> float:
    """Seconds until no live session is open and no KV block is in use; fails past ``within``."""
    started = time.monotonic()
    while (got := live_metrics(server)) != (0, 0):
        assert time.monotonic() - started < within, f"(live sessions, KV blocks in use) still {got}"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.parametrize("how", ["drop", "close"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_fast_sender_that_leaves_with_a_full_backlog_frees_its_session(server, speech, protocol, how) -> None:
    async def run() -> None:
        client = await Client.open(server, protocol)
        sending = asyncio.create_task(client.send_audio(pcm16(speech, 40)))
        await client.until_backlog_full()
        assert live_metrics(server)[0] == 1
        if how == "drop":
            client.drop()
        else:
            await client.ws.close()
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)

    asyncio.run(run())
    print(f"{protocol}, {how}: freed in {wait_freed(server):.2f} s")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_client_gone_quiet_after_a_full_backlog_is_closed_idle(server, speech, protocol) -> None:
    async def run() -> tuple[list[dict], int | None]:
        client = await Client.open(server, protocol)
        await client.send_audio(pcm16(speech, BACKLOG_S + 2))  # then nothing more, the connection kept
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await client.next(timeout=BACKLOG_S + IDLE_S + 30)
        return client.events, client.ws.close_code

    events, code = asyncio.run(run())
    last = events[-1]
    assert code == 1000
    assert (last["error"]["code"] if protocol == "realtime" else last["code"]) == "session_idle"
    wait_freed(server)


async def send_all_at_once(server: ServerProcess, protocol: str, data: bytes, **keepalive) -> list[dict]:  # noqa: ANN003
    """``data`` sent as fast as the socket takes it, then the end of the stream; every event until the end."""
    client = await Client.open(server, protocol, **keepalive)
    await client.send_audio(data)
    await client.end()
    if protocol == "realtime":
        await client.ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    last = "input_audio_buffer.cleared" if protocol == "realtime" else "done"
    while (await client.next(timeout=300))["type"] != last:
        pass
    await client.ws.close()
    return client.events


def assert_every_turn(events: list[dict], protocol: str, seconds: float, speech: np.ndarray) -> None:
    assert not [e for e in events if e["type"] == "error" and "commit" not in json.dumps(e)]
    final = "conversation.item.input_audio_transcription.completed" if protocol == "realtime" else "final"
    assert sum(e["type"] == final for e in events) >= seconds // (speech.size / 16000)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_fast_sender_answers_pings_while_its_audio_waits(server, speech, protocol) -> None:
    """Three backlogs of audio sent at once: it waits for many seconds of engine steps, yet a client that
    pings every 0.5 s and gives up after 3 s without a pong stays connected and gets every turn (the
    server reads on, answering pings, while the session takes the audio in turn)."""
    seconds = 3 * BACKLOG_S
    started = time.monotonic()
    events = asyncio.run(send_all_at_once(server, protocol, pcm16(speech, seconds), ping_interval=0.5,
                                          ping_timeout=3))
    assert_every_turn(events, protocol, seconds, speech)
    print(f"{protocol}: {seconds} s of audio sent at once, transcribed in {time.monotonic() - started:.1f} s")
    wait_freed(server)


@pytest.mark.slow
def test_a_fast_sender_with_the_default_keepalive_stays_connected_through_a_minute(server, speech) -> None:
    """The websockets client's own keepalive (a ping every 20 s, 20 s for its pong) through 64 s of audio
    sent at once, which takes about its length to transcribe on the demo model."""
    seconds = 64
    started = time.monotonic()
    events = asyncio.run(send_all_at_once(server, "realtime", pcm16(speech, seconds)))
    assert_every_turn(events, "realtime", seconds, speech)
    print(f"{seconds} s of audio sent at once, default keepalive: transcribed in {time.monotonic() - started:.1f} s")
    wait_freed(server)


def test_every_drop_frees_its_place_for_the_next_client(server, speech) -> None:
    """More drops with a full backlog than the server has places: each next session is admitted."""
    async def run() -> None:
        for k in range(MAX_SESSIONS + 2):
            client = await Client.open(server, PROTOCOLS[k % 2])
            assert client.events[-1]["type"] in ("session.created", "ready")
            sending = asyncio.create_task(client.send_audio(pcm16(speech, 20)))
            await client.until_backlog_full()
            client.drop()
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)

    asyncio.run(run())
    wait_freed(server)


def test_sigterm_with_full_and_abandoned_backlogs_drains_and_exits_cleanly(tmp_path: Path, speech) -> None:
    """A drain meets a session whose client dropped with a full backlog and one still sending: both end
    (the live one with ``shutting_down`` and 1001), the server exits 0 and logs no traceback."""
    srv = ServerProcess(tmp_path / "serve.log", "--live-max-backlog-s", str(BACKLOG_S), "--drain-timeout", "20")
    try:
        srv.wait_ready()

        async def run() -> tuple[dict, int | None]:
            gone = await Client.open(srv, "realtime")
            gone_sending = asyncio.create_task(gone.send_audio(pcm16(speech, 40)))
            await gone.until_backlog_full()
            gone.drop()
            live = await Client.open(srv, "stream")
            sending = asyncio.create_task(live.send_audio(pcm16(speech, 40)))
            await live.until_backlog_full()
            srv.proc.terminate()  # SIGTERM: drain
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await live.next()
            for task in (gone_sending, sending):
                task.cancel()
            await asyncio.gather(gone_sending, sending, return_exceptions=True)
            return live.events[-1], live.ws.close_code

        last, code = asyncio.run(run())
        assert last["code"] == "shutting_down" and code == 1001
        assert srv.proc.wait(30) == 0
        log = srv.log()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    finally:
        srv.stop()


SOAK_SESSIONS = 200
SOAK_CONCURRENCY = 8


async def soak_session(server: ServerProcess, speech: np.ndarray, plan: dict) -> int:
    """One planned session; returns how many times it was refused for want of a place and retried."""
    refused = 0
    while True:
        try:
            client = await Client.open(server, plan["protocol"])
            break
        except (Refused, websockets.ConnectionClosed) as exc:  # too_many_sessions: a place not freed yet
            assert "too_many_sessions" in str(exc) or "max-live-sessions" in str(exc), exc
            refused += 1
            await asyncio.sleep(0.1)

    async def listen() -> None:
        with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
            while True:
                await client.next()

    listening = asyncio.create_task(listen())
    pace = 0.0 if plan["fast"] else 0.025  # fast: as the socket takes it; slow: 4x real time
    sending = asyncio.create_task(client.send_audio(pcm16(speech, plan["seconds"]), step=3200, pace_s=pace))
    if plan["how"] == "end":
        await sending
        await client.end()
        await client.ws.close()  # once the end is sent: gone before (or while) the last turn comes
    else:
        await asyncio.sleep(plan["after_s"])
        if plan["how"] == "drop":
            client.drop()
        else:
            await client.ws.close()
    for task in (sending, listening):
        task.cancel()
    await asyncio.gather(sending, listening, return_exceptions=True)
    return refused


@pytest.mark.slow
def test_soak_sessions_that_leave_at_random_moments_leave_nothing_held(server, speech) -> None:
    """200 sessions, 8 at a time: both protocols, fast and slow senders, each gone at a random moment
    (dropped, closed, or right after its end), many with a full backlog. At the end no session is open, no
    KV block is in use, and the server logged no traceback."""
    rng = random.Random(50)
    plans = [{"protocol": rng.choice(PROTOCOLS), "fast": rng.random() < 0.5,
              "how": rng.choice(["drop", "close", "end"]), "seconds": rng.uniform(1, 2 * BACKLOG_S),
              "after_s": rng.uniform(0, 1.5)} for _ in range(SOAK_SESSIONS)]

    async def run() -> list[int]:
        gate = asyncio.Semaphore(SOAK_CONCURRENCY)

        async def one(plan: dict) -> int:
            async with gate:
                return await soak_session(server, speech, plan)

        return await asyncio.gather(*(one(p) for p in plans))

    started = time.monotonic()
    refused = asyncio.run(run())
    took = time.monotonic() - started
    freed = wait_freed(server, within=30)
    assert "Traceback" not in server.log()
    print(f"soak: {SOAK_SESSIONS} sessions in {took:.1f} s, {sum(refused)} retries for a place, all freed "
          f"{freed:.2f} s after the last")


# --- in-process: the runner and the channel when sending fails


class FakeSession:
    def __init__(self) -> None:
        self.closed = 0
        self.in_turn = False

    def push(self, samples: np.ndarray) -> list:
        return ["event"]

    def commit(self) -> list:
        return []

    def finish(self) -> list:
        return []

    def clear(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def runner_with(emit, max_backlog_s: float = 1.0):  # noqa: ANN001, ANN201
    from concurrent.futures import ThreadPoolExecutor

    from qasr.server.live_runner import LiveRunner
    from qasr.streaming.ingest import PcmIngest

    async def fail(exc: Exception) -> None:
        raise AssertionError(f"no operation fails here: {exc!r}")

    session = FakeSession()
    return LiveRunner(session, PcmIngest(), emit, fail, max_backlog_s, ThreadPoolExecutor(2)), session


def test_a_send_that_fails_abandons_and_frees_the_session_and_keeps_the_worker() -> None:
    from starlette.websockets import WebSocketDisconnect

    async def run() -> None:
        sent = []

        async def emit(op: str, events: list) -> None:
            sent.append(op)
            raise WebSocketDisconnect(1006)  # the client is gone

        runner, session = runner_with(emit)
        runner.audio(np.zeros(16000 * 3, "<i2").tobytes())  # three chunks: a full backlog
        assert not runner.has_room()
        for _ in range(200):
            if session.closed:
                break
            await asyncio.sleep(0.01)
        assert session.closed == 1 and sent == ["audio"]  # freed at the first failed send; nothing more sent
        assert runner.has_room() and not runner._worker.done()
        await runner.close()
        await runner.close()  # idempotent
        assert runner._worker.done() and not runner.busy and session.closed == 2

    asyncio.run(run())


def test_a_send_that_never_finishes_means_the_client_is_gone() -> None:
    from starlette.websockets import WebSocketDisconnect, WebSocketState

    from qasr.server.live_ws import Channel

    class StuckSocket:
        application_state = WebSocketState.CONNECTED

        async def send_text(self, text: str) -> None:
            await asyncio.Event().wait()  # a client that never reads: the transport stays full

        async def receive(self) -> dict:
            await asyncio.Event().wait()
            raise AssertionError

    class State:
        draining = False

        @staticmethod
        def engine_losses() -> int:
            return 0

        class config:  # noqa: N801
            live_idle_timeout_s = 0.2

    async def run() -> None:
        channel = Channel(StuckSocket(), State())  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(WebSocketDisconnect):
            await channel.send({"type": "x"})
        assert time.monotonic() - started < 2 and channel.gone == 1006
        with pytest.raises(WebSocketDisconnect):  # the session's receive loop sees it at once
            await channel.receive()
        await channel.stop()

    asyncio.run(run())
