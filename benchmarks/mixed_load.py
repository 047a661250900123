"""One engine, everything at once: a long file, live sessions in real time, and HTTP clients that cancel.

One ``qasr serve`` process serves, at the same time:

* **the file**: ``--file-minutes`` (20) of espeak-ng speech with pauses (distinct sentences of the demo
  model's grammar, six voices, 130-190 words per minute; made once and cached in ``--cache``) posted as one
  ``POST /v1/audio/transcriptions`` (``response_format=verbose_json``), started with the live sessions
  (``--file-at S``: S seconds after them; ``--file-loop``: posted again as soon as it is answered, until they
  end, so that it runs in every minute; its throughput figure is the first request's); besides the p95 per
  minute, the report gives the p95 of the pushes sent while the file ran;
* **live sessions**: ``--live`` (16) WebSocket sessions on the native ``/v1/stream``, each fed in real time
  (pcm16 at 16 kHz, 100 ms binary messages paced by the wall clock, session i starting i/N s late) from one
  of ``--live-variants`` (4) espeak tracks with pauses, for ``--live-seconds`` (180) each, then ``end``;
  ``--drop`` (2) of them disconnect abruptly (the TCP connection is aborted) at a random moment in the
  middle 40% of their audio and reconnect at once as a new session that carries on with the rest of the
  audio on the same wall-clock schedule;
* **HTTP clients**: ``--http`` (4) clients in a closed loop, each posting one of ``--http-clips`` (24)
  espeak clips of 2-15 s (``response_format=json``) after the other until the live sessions end; a share
  ``--cancel-share`` (0.1) of the requests is abandoned: the client cancels it after a random 0.05-2 s,
  which closes its connection (the server counts such a request as status 499).

Figures:

* **live push latency**, per minute of the run (by the moment the message was sent): for a 100 ms message,
  the time from sending it to receiving the first ``progress`` event whose ``audio_seconds`` reaches the
  message's end. The server sends ``progress`` after every whole second of audio processed, with the
  processed count; every message holds exactly 1,600 samples, so a progress event accounts *exactly* for
  the message that completes its second (the other nine messages of the second are accounted for only by
  the same event, which also waits for audio not sent yet: they are left out). So one latency sample per
  session per second: sending of the second's last message to the server's report that it is processed,
  which includes every queue it waited in behind the earlier messages' work (decode steps among them).
  A step that ran long in the middle of a second shows only as far as it delayed that second's last
  message. With ``--ack-every-message`` the server runs with ``--live-max-backlog-s 0.4``, whose progress
  reports come after every 100 ms of audio (``min(1 s, backlog / 4)``), so every message gets its own
  sample; the flow control then also stops reading a session's socket while 0.4 s of its audio waits
  (TCP holds the rest; the send time is still the client's).
  ``partial`` and ``final`` events are not used: they say nothing about how much audio they account for.
* **file**: the long request's wall time (upload to answer) and its audio seconds per wall second.
* **HTTP**: latency (send to answer) p50/p95 of the completed requests; counts completed / cancelled /
  failed, next to the server's own counts by status from ``/metrics``.
* **engine**: ``/metrics`` sampled once a second: ``qasr_engine_kv_tokens_used`` / ``_total``, running and
  waiting requests, and every other ``qasr_engine_*`` gauge (``qasr_engine_kv_blocks_*``,
  ``qasr_engine_preemptions*`` when the engine exports them; "not exported" otherwise).
* **correctness**: before the mixed run, through the same server, one at a time: the file, every HTTP
  clip, and one session per live track (sent as fast as the flow control lets it: its turns and finals do
  not depend on the timing); afterwards every completed HTTP text, the file's text and every undisturbed
  live session's finals (texts, in order, and their count) must equal those. "Nothing lost": every
  request completed, was cancelled by its client, or failed with an error that is reported; every
  undisturbed session got ``done`` and a final for every turn its alone run had.

``--concurrency-gain`` is another mode, in-process (``qasr serve`` has no flag for the KV cache size):
``ASR.from_pretrained(..., engine=EngineConfig(kv_cache_bytes=--kv-gib GiB))`` gets ``--gain-requests``
(32) requests of 30 s speech at once; the engine's stats are polled every 10 ms for the most requests
running at once and the most KV tokens used. Its JSON carries the git commit and the EngineStats fields,
to compare today's engine (a contiguous region reserved for prompt + cap) with the block-table engine.

    .venv/bin/python benchmarks/mixed_load.py                     # the demo model, float32, the full run
    .venv/bin/python benchmarks/mixed_load.py --quick             # a smoke run of a few minutes
    .venv/bin/python benchmarks/mixed_load.py --dims 0.6b         # a speaking random checkpoint, 0.6B dims, bf16
    .venv/bin/python benchmarks/mixed_load.py --concurrency-gain [--kv-gib 0.03]

Prints a table, writes JSON and a PNG to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import logging
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
import soxr

from qasr import TranscribeOptions
from qasr.audio.io import SAMPLE_RATE as SR
from qasr.bench.common import percentile, start_server
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_demo_data import unique_sentences  # noqa: E402 - the demo model's grammar: sentences it knows

MSG = SR // 10  # samples per live message: 100 ms
VOICES = (("en-us", 160), ("en-gb", 150), ("en-us+f3", 170), ("en-gb-scotland", 145), ("en-us+m3", 180),
          ("en-029", 140))
TARGET_MS = 500.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default models/qasr-demo-en)")
    p.add_argument("--dims", choices=("demo", "0.6b"), default="demo",
                   help="0.6b: a random checkpoint with the real 0.6B dimensions that speaks words (bf16), built "
                        "once in --cache; demo (default): --model")
    p.add_argument("--dtype", default=None, help="default float32 (demo), bfloat16 (0.6b)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--language", default="English", help="forced on every request and session")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2-minute file, 4 live sessions for 40 s, 2 HTTP clients, 1 drop")
    p.add_argument("--file-minutes", type=float, default=None, help="the long file (default 20)")
    p.add_argument("--file-loop", action="store_true",
                   help="post the file again as soon as it is answered, until the live sessions end (the file "
                        "then runs during every minute; the figures are the first request's)")
    p.add_argument("--file-at", type=float, default=0.0,
                   help="post the file this many seconds after the live sessions start (default 0: at once)")
    p.add_argument("--live", type=int, default=None, help="live sessions (default 16)")
    p.add_argument("--live-seconds", type=float, default=None, help="audio per live session (default 180)")
    p.add_argument("--live-variants", type=int, default=None, help="distinct live tracks (default 4)")
    p.add_argument("--http", type=int, default=None, help="closed-loop HTTP clients (default 4)")
    p.add_argument("--http-clips", type=int, default=None, help="distinct HTTP clips of 2-15 s (default 24)")
    p.add_argument("--cancel-share", type=float, default=0.1, help="HTTP requests abandoned (default 0.1)")
    p.add_argument("--live-settings", type=json.loads, default={},
                   help="more keys of every live session's start message, a JSON object "
                        "(e.g. '{\"end_on_chunk\": true}')")
    p.add_argument("--drop", type=int, default=None, help="live sessions that disconnect mid-stream (default 2)")
    p.add_argument("--ack-every-message", action="store_true",
                   help="serve with --live-max-backlog-s 0.4: a progress event per 100 ms message (see above)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency-gain", action="store_true", help="the other mode (in-process, see above)")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="KV cache for --concurrency-gain (default 0.03 GiB at demo dims, 0.75 at 0.6b)")
    p.add_argument("--gain-requests", type=int, default=32, help="30 s requests submitted at once (default 32)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    quick = dict(file_minutes=2.0, live=4, live_seconds=40.0, live_variants=2, http=2, http_clips=8, drop=1)
    full = dict(file_minutes=20.0, live=16, live_seconds=180.0, live_variants=4, http=4, http_clips=24, drop=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.drop = min(args.drop, args.live)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.dims == "0.6b":
        from qasr.testing import QWEN3_ASR_0_6B_DIMS
        from qasr.testing.speaking import speaking_checkpoint

        # the same cache entry as benchmarks/streaming.py's and server_load.py's
        args.model = str(speaking_checkpoint(args.cache / "streaming-0.6b-dims-random-words-hf",
                                             dict(QWEN3_ASR_0_6B_DIMS), "words"))
        args.dtype = args.dtype or "bfloat16"
        args.kv_gib = args.kv_gib or 0.75
    else:
        args.model = args.model or str(ROOT / "models" / "qasr-demo-en")
        args.dtype = args.dtype or "float32"
        args.kv_gib = args.kv_gib or 0.03
    return args


# ---------------------------------------------------------------------------------------------- audio

def speech_track(seconds: float, seed: int, folder: Path, pauses: tuple[float, float] = (0.3, 3.0)) -> np.ndarray:
    """``seconds`` of espeak-ng speech at 16 kHz: distinct grammar sentences, a voice and speed per sentence,
    pauses drawn from ``pauses`` (one in eight 4-8 s long); cut to whole 100 ms messages."""
    r = random.Random(seed)
    texts = unique_sentences(r, max(8, int(seconds / 2)), set())
    parts, total = [], 0
    for k, text in enumerate(texts):
        voice, speed = VOICES[r.randrange(len(VOICES))]
        wav = speak(text, folder / f"s{seed}_{k}.wav", voice=voice, speed=speed + r.randint(-10, 10))
        wave, rate = sf.read(wav, dtype="float32")
        pause = r.uniform(4, 8) if r.random() < 0.125 else r.uniform(*pauses)
        parts += [0.6 * soxr.resample(wave, rate, SR), np.zeros(int(pause * SR), np.float32)]
        total += len(parts[-2]) + len(parts[-1])
        if total >= seconds * SR:
            break
    audio = np.concatenate(parts).astype(np.float32)[:int(seconds * SR)]
    if len(audio) < seconds * SR:
        audio = np.concatenate([audio, np.zeros(int(seconds * SR) - len(audio), np.float32)])
    return audio[:len(audio) // MSG * MSG]


def cached_track(cache: Path, name: str, seconds: float, seed: int, **kw: object) -> np.ndarray:
    path = cache / f"mixed_{name}_{seconds:g}s_seed{seed}.flac"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            print(f"speaking {path.name} ({seconds:g} s) ...", flush=True)
            sf.write(path, speech_track(seconds, seed, Path(tmp), **kw), SR, subtype="PCM_16")
    audio, _ = sf.read(path, dtype="float32")
    return audio


def wav_bytes(audio: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, SR, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def make_audio(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    long = cached_track(args.cache, "file", args.file_minutes * 60, args.seed)
    live = [cached_track(args.cache, "live", args.live_seconds, args.seed + 100 + v)
            for v in range(args.live_variants)]
    clips = []
    for c in range(args.http_clips):  # 2-15 s, pauses of 0.2-0.8 s (sent whole: no VAD cut below 30 s)
        seconds = float(rng.uniform(2, 15))
        clips.append(cached_track(args.cache, f"clip{c}", round(seconds, 1), args.seed + 1000 + c, pauses=(0.2, 0.8)))
    return {"file": wav_bytes(long), "file_s": len(long) / SR, "live": [pcm16(a) for a in live],
            "live_s": [len(a) / SR for a in live], "clips": [wav_bytes(c) for c in clips],
            "clips_s": [len(c) / SR for c in clips]}


# ---------------------------------------------------------------------------------------------- HTTP

async def transcribe(client: httpx.AsyncClient, url: str, data: bytes, fmt: str, language: str) -> dict:
    started = time.perf_counter()
    r = await client.post(f"{url}/v1/audio/transcriptions", files={"file": ("audio.wav", data, "audio/wav")},
                          data={"response_format": fmt, "language": language})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return {"latency_s": time.perf_counter() - started, "started": started, "body": r.json()}


async def http_client(c: int, client: httpx.AsyncClient, url: str, audio: dict, args: argparse.Namespace,
                      stop: asyncio.Event, t0: float) -> list[dict]:
    """Closed loop until ``stop``: post a random clip; a share is cancelled after 0.05-2 s."""
    r = random.Random(args.seed * 1000 + c)
    out = []
    while not stop.is_set():
        k = r.randrange(len(audio["clips"]))
        cancel_after = r.uniform(0.05, 2.0) if r.random() < args.cancel_share else None
        task = asyncio.ensure_future(transcribe(client, url, audio["clips"][k], "json", args.language))
        started = time.perf_counter() - t0
        done, _ = await asyncio.wait({task}, timeout=cancel_after)
        row = {"client": c, "clip": k, "at_s": started, "cancel_after_s": cancel_after}
        if not done:  # the client gives up: cancelling the request closes its connection
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            out.append({**row, "status": "cancelled"})
            continue
        try:
            res = task.result()
            out.append({**row, "status": "completed", "latency_s": res["latency_s"], "text": res["body"]["text"]})
        except Exception as exc:  # noqa: BLE001 - counted and reported
            out.append({**row, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
    return out


def scrape(url: str) -> dict[str, float]:
    """Every sample line of /metrics as name{labels} -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


async def sample_metrics(url: str, stop: asyncio.Event, t0: float) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                text = (await client.get(f"{url}/metrics")).text
            except httpx.HTTPError as exc:
                rows.append({"t_s": t - t0, "error": repr(exc)})
            else:
                row = {"t_s": t - t0}
                for line in text.splitlines():
                    if line.startswith("qasr_engine_"):
                        key, _, value = line.rpartition(" ")
                        row[key] = float(value)
                rows.append(row)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, 1.0 - (time.perf_counter() - t)))
            except TimeoutError:
                pass
    return rows


# ---------------------------------------------------------------------------------------------- live

class LiveClient:
    """One native /v1/stream session: sends messages ``first..`` of ``pcm`` (real time on a wall-clock
    schedule, or as fast as the flow control allows), records when each was sent and every event."""

    def __init__(self, url: str, pcm: bytes, language: str, settings: dict | None = None) -> None:
        self.ws_url = url.replace("http://", "ws://") + "/v1/stream"
        self.msgs = [pcm[i:i + 2 * MSG] for i in range(0, len(pcm), 2 * MSG)]
        self.language = language
        self.settings = settings or {}  # more keys of the start message (--live-settings)
        self.sent: dict[int, float] = {}
        self.progress: list[tuple[float, float]] = []  # (audio_seconds, received at)
        self.finals: list[dict] = []
        self.errors: list[dict] = []
        self.done: dict | None = None
        self.aborted = False

    async def run(self, first: int = 0, schedule: float | None = None, abort_at: int | None = None) -> None:
        """``schedule``: the perf_counter time message 0 is due (message k at schedule + k/10); None: fast.
        ``abort_at``: abort the connection instead of sending that message (an abrupt disconnect)."""
        from websockets.asyncio.client import connect

        self.first = first
        async with connect(self.ws_url, max_size=None, ping_interval=None, open_timeout=120, close_timeout=5) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": SR, "format": "pcm16",
                                      "language": self.language, **self.settings}))
            ready = json.loads(await ws.recv())
            if ready.get("type") != "ready":
                raise RuntimeError(f"no ready event: {ready}")
            half_backlog = ready["config"]["max_backlog_seconds"] / 2
            self.processed = 0.0
            self._moved = asyncio.Event()
            receiver = asyncio.ensure_future(self._receive(ws))
            try:
                for k in range(first, len(self.msgs)):
                    if k == abort_at:
                        self.aborted = True
                        ws.transport.abort()
                        break
                    if schedule is not None:
                        await asyncio.sleep(max(0.0, schedule + k / 10 - time.perf_counter()))
                    else:
                        while (k - first) / 10 - self.processed > half_backlog and not receiver.done():
                            self._moved.clear()
                            await self._moved.wait()
                    self.sent[k] = time.perf_counter()
                    await ws.send(self.msgs[k])
                if not self.aborted:
                    await ws.send(json.dumps({"type": "end"}))
                await receiver
            finally:
                receiver.cancel()

    async def _receive(self, ws) -> None:  # noqa: ANN001
        from websockets.exceptions import ConnectionClosed

        try:
            async for message in ws:
                t = time.perf_counter()
                event = json.loads(message)
                kind = event.get("type")
                if kind == "progress":
                    self.progress.append((event["audio_seconds"], t))
                    self.processed = event["audio_seconds"]
                    self._moved.set()
                elif kind == "final":
                    self.finals.append(event)
                elif kind == "error":
                    self.errors.append(event)
                elif kind == "done":
                    self.done = event
        except ConnectionClosed:
            if not self.aborted:
                self.errors.append({"code": "connection_closed", "message": "closed before done"})
        finally:
            self._moved.set()

    def latencies(self, t0: float) -> list[tuple[float, float]]:
        """(sent at, s since t0; latency s) for each message a progress event accounts for exactly."""
        out = []
        for seconds, t in self.progress:
            k = self.first + round(seconds * 10) - 1  # the message whose end is that audio position
            if k in self.sent:
                out.append((self.sent[k] - t0, t - self.sent[k]))
        return out


async def live_session(i: int, url: str, audio: dict, args: argparse.Namespace, schedule: float,
                       abort_at: int | None) -> list[LiveClient]:
    pcm = audio["live"][i % len(audio["live"])]
    first = LiveClient(url, pcm, args.language, args.live_settings)
    clients = [first]
    await first.run(0, schedule, abort_at)
    if abort_at is not None:  # reconnect at once as a new session with the rest of the audio
        again = LiveClient(url, pcm, args.language, args.live_settings)
        clients.append(again)
        await again.run(abort_at, schedule)
    return clients


# ---------------------------------------------------------------------------------------------- phases

async def warm_up(url: str, audio: dict, args: argparse.Namespace) -> float:
    """A fresh server pays for every new shape once (measured here: the first live session of 15 s took
    38.6 s, the next 2.1 s): before anything is measured, the first 30 s of every live track in
    ``min(--live, 8)`` concurrent sessions (as fast as they go) with every clip at once, then the file."""
    started = time.perf_counter()
    head = [pcm[:30 * SR * 2] for pcm in audio["live"]]
    async with httpx.AsyncClient(timeout=None) as client:
        sessions = [LiveClient(url, head[i % len(head)], args.language, args.live_settings)
                    for i in range(min(args.live, 8))]
        await asyncio.gather(*(c.run() for c in sessions),
                             *(transcribe(client, url, c, "json", args.language) for c in audio["clips"]))
        await transcribe(client, url, audio["file"], "json", args.language)
    return time.perf_counter() - started


async def alone(url: str, audio: dict, args: argparse.Namespace) -> dict:
    """Every input transcribed alone through the same server, one at a time."""
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.perf_counter()
        file = await transcribe(client, url, audio["file"], "verbose_json", args.language)
        print(f"alone: the file in {file['latency_s']:.1f} s", flush=True)
        clips = [(await transcribe(client, url, c, "json", args.language))["body"]["text"] for c in audio["clips"]]
        print(f"alone: {len(clips)} clips", flush=True)
    live = []
    for pcm in audio["live"]:
        c = LiveClient(url, pcm, args.language, args.live_settings)
        await c.run()
        if c.done is None or c.errors:
            raise RuntimeError(f"the alone live session failed: {c.errors}")
        live.append([f["text"] for f in c.finals])
    print(f"alone: {len(live)} live tracks, {[len(x) for x in live]} turns; "
          f"{time.perf_counter() - started:.1f} s in all", flush=True)
    return {"file_text": file["body"]["text"], "file_segments": len(file["body"].get("segments", [])),
            "file_latency_s": file["latency_s"], "clips": clips, "live": live}


async def file_requests(client: httpx.AsyncClient, url: str, audio: dict, args: argparse.Namespace,
                        stop: asyncio.Event, t0: float) -> list[dict]:
    """The long file once (with ``--file-loop``: again and again until the live sessions end)."""
    out = []
    await asyncio.sleep(max(0.0, t0 + args.file_at - time.perf_counter()))
    while not out or args.file_loop and not stop.is_set():
        try:
            f = await transcribe(client, url, audio["file"], "verbose_json", args.language)
            out.append({"latency_s": f["latency_s"], "start_s": f["started"] - t0, "text": f["body"]["text"],
                        "segments": len(f["body"].get("segments", [])), "error": None})
        except Exception as exc:  # noqa: BLE001 - reported
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            break
    return out


async def mixed(url: str, audio: dict, args: argparse.Namespace) -> dict:
    r = random.Random(args.seed)
    t0 = time.perf_counter() + 1.0
    stop_http, stop_metrics = asyncio.Event(), asyncio.Event()
    n_msgs = [len(audio["live"][i % len(audio["live"])]) // (2 * MSG) for i in range(args.live)]
    drops = {i: int(n_msgs[i] * r.uniform(0.3, 0.7)) for i in r.sample(range(args.live), args.drop)}
    metrics = asyncio.ensure_future(sample_metrics(url, stop_metrics, t0))
    limits = httpx.Limits(max_connections=args.http + 4, max_keepalive_connections=args.http + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client, \
            httpx.AsyncClient(timeout=None) as file_client:
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        file_task = asyncio.ensure_future(file_requests(file_client, url, audio, args, stop_http, t0))
        sessions = [asyncio.ensure_future(live_session(i, url, audio, args, t0 + i / max(1, args.live),
                                                       drops.get(i))) for i in range(args.live)]
        https = [asyncio.ensure_future(http_client(c, client, url, audio, args, stop_http, t0))
                 for c in range(args.http)]
        live = await asyncio.gather(*sessions, return_exceptions=True)
        live_end = time.perf_counter() - t0
        stop_http.set()
        http = [row for rows in await asyncio.gather(*https) for row in rows]
        files = await file_task
    stop_metrics.set()
    return {"t0": t0, "live": live, "drops": drops, "http": http, "files": files, "live_end_s": live_end,
            "metrics": await metrics}


def per_minute(samples: list[tuple[float, float]]) -> list[dict]:
    by: dict[int, list[float]] = {}
    for at, lat in samples:
        by.setdefault(int(at // 60), []).append(lat)
    return [{"minute": m, "n": len(v), "p50_ms": 1e3 * percentile(v, 0.5), "p95_ms": 1e3 * percentile(v, 0.95),
             "max_ms": 1e3 * max(v)} for m, v in sorted(by.items())]


def file_ran_in(minute: int, file_span: tuple[float, float]) -> bool:
    """Whether the file was being transcribed during some of that minute of the run."""
    return minute * 60 < file_span[1] and (minute + 1) * 60 > file_span[0]


def summarize(run: dict, ref: dict, audio: dict, args: argparse.Namespace, server_counts: dict) -> dict:
    t0 = run["t0"]
    samples, live_rows, mismatches = [], [], []
    for i, res in enumerate(run["live"]):
        if isinstance(res, BaseException):
            live_rows.append({"session": i, "error": f"{type(res).__name__}: {res}"})
            continue
        want = ref["live"][i % len(ref["live"])]
        for part, c in enumerate(res):
            samples += c.latencies(t0)
            row = {"session": i, "part": part, "dropped": i in run["drops"], "aborted": c.aborted,
                   "done": c.done is not None, "finals": len(c.finals), "errors": c.errors,
                   "messages_sent": len(c.sent)}
            if i not in run["drops"]:
                got = [f["text"] for f in c.finals]
                row["equal_alone"] = got == want
                row["turns_alone"] = len(want)
                if got != want:
                    mismatches.append({"kind": "live", "session": i, "got": got, "want": want})
            live_rows.append(row)
    minutes = per_minute(samples)
    http = run["http"]
    done = [h for h in http if h["status"] == "completed"]
    for h in done:
        if h["text"] != ref["clips"][h["clip"]]:
            mismatches.append({"kind": "http", "clip": h["clip"], "got": h["text"], "want": ref["clips"][h["clip"]]})
    files = run["files"]
    for f in files:
        if f.get("error") is None:
            f["equal_alone"] = f["text"] == ref["file_text"]
            if not f["equal_alone"]:
                mismatches.append({"kind": "file", "got": f["text"][:500], "want": ref["file_text"][:500]})
    file = {k: v for k, v in files[0].items() if k != "text"}
    if file.get("error") is None:
        file["audio_s"] = audio["file_s"]
        file["audio_per_wall_s"] = audio["file_s"] / file["latency_s"]
    file["requests"] = len(files)
    file["failed"] = [f["error"] for f in files if f.get("error")]
    file["all_equal_alone"] = all(f.get("equal_alone", False) for f in files)
    done_files = [f for f in files if f.get("error") is None]
    undisturbed = [r for r in live_rows if "equal_alone" in r]
    lost = [r for r in live_rows if "error" in r or not r["done"] and not r["aborted"]
            or ("turns_alone" in r and r["finals"] != r["turns_alone"])]
    lost += [h for h in http if h["status"] == "failed" and not h.get("error")]
    lost += [{"file": f["error"]} for f in files if f.get("error")]
    lat = [h["latency_s"] for h in done]
    file_span = (done_files[0]["start_s"], done_files[-1]["start_s"] + done_files[-1]["latency_s"]) if done_files \
        else (0.0, 0.0)
    during = [m for m in minutes if file_ran_in(m["minute"], file_span)] or minutes
    worst = max(during, key=lambda m: m["p95_ms"]) if during else None
    in_span = [lat for at, lat in samples if file_span[0] <= at < file_span[1]]
    return {"samples": samples, "live_minutes": minutes, "live_samples": len(samples), "live_sessions": live_rows,
            "file": file,
            "http": {"completed": len(done), "cancelled": sum(h["status"] == "cancelled" for h in http),
                     "failed": sum(h["status"] == "failed" for h in http),
                     "errors": [h["error"] for h in http if h["status"] == "failed"][:10],
                     "p50_s": percentile(lat, 0.5), "p95_s": percentile(lat, 0.95), "server": server_counts},
            "mismatches": mismatches, "undisturbed_sessions": len(undisturbed),
            "undisturbed_equal": sum(r["equal_alone"] for r in undisturbed), "lost": lost,
            "nothing_lost": not lost, "file_span_s": file_span, "target_minute": worst,
            "file_span_push_ms": {"n": len(in_span), "p95": 1e3 * percentile(in_span, 0.95) if in_span else None,
                                  "max": 1e3 * max(in_span) if in_span else None},
            "live_end_s": run["live_end_s"]}


def engine_gauges(rows: list[dict]) -> dict[str, dict]:
    """Per qasr_engine_* gauge: mean and max over the samples."""
    names = sorted({k for r in rows for k in r if k.startswith("qasr_engine_")})
    return {n: {"mean": float(np.mean([r[n] for r in rows if n in r])), "max": max(r[n] for r in rows if n in r)}
            for n in names}


def report(s: dict, gauges: dict, args: argparse.Namespace, meta: dict) -> None:
    print(f"\n{meta['cpu']}, {meta['commit']}, model {args.model}, {args.dtype}; {args.live} live sessions x "
          f"{args.live_seconds:g} s ({args.drop} dropped and reconnected), {args.http} HTTP clients "
          f"(cancel share {args.cancel_share:g}), a {args.file_minutes:g}-minute file")
    print(f"{'minute':>6} {'samples':>8} {'push p50 ms':>12} {'push p95 ms':>12} {'max ms':>8}")
    span = s["file_span_s"]
    for m in s["live_minutes"]:
        mark = " (file running)" if file_ran_in(m["minute"], span) else ""
        print(f"{m['minute']:>6} {m['n']:>8} {m['p50_ms']:>12.0f} {m['p95_ms']:>12.0f} {m['max_ms']:>8.0f}{mark}")
    f = s["file"]
    if f.get("error"):
        print(f"file: FAILED {f['error']}")
    else:
        print(f"file: {f['audio_s']:.0f} s of audio in {f['latency_s']:.1f} s ({f['audio_per_wall_s']:.1f} audio s per "
              f"wall s; alone {meta['alone_file_latency_s']:.1f} s), {f['segments']} segments; {f['requests']} "
              f"request(s) from {span[0]:.1f} to {span[1]:.1f} s of the run")
    h = s["http"]
    print(f"HTTP: {h['completed']} completed (p50 {h['p50_s']:.2f} s, p95 {h['p95_s']:.2f} s), {h['cancelled']} "
          f"cancelled, {h['failed']} failed; the server counted {h['server']}")
    for e in h["errors"]:
        print(f"  failed: {e}")
    print("engine (/metrics once a second, mean / max):")
    for n, g in gauges.items():
        print(f"  {n:<42} {g['mean']:>10.1f} {g['max']:>10.0f}")
    for prefix in ("qasr_engine_kv_blocks", "qasr_engine_preemptions"):
        if not any(n.startswith(prefix) for n in gauges):
            print(f"  {prefix}_*: not exported")
    print(f"correctness: {len(s['mismatches'])} mismatches against the alone results "
          f"(file {'equal' if f['all_equal_alone'] else 'NOT equal'}, {h['completed']} HTTP results, "
          f"{s['undisturbed_equal']} of {s['undisturbed_sessions']} undisturbed live sessions equal); "
          f"nothing lost: {s['nothing_lost']}")
    for m in s["mismatches"][:5]:
        print(f"  mismatch: {json.dumps(m)[:300]}")
    for row in s["lost"][:5]:
        print(f"  lost: {json.dumps(row)[:300]}")
    w = s["target_minute"]
    if w is not None:
        print(f"live p95 push latency at minute {w['minute']}: {w['p95_ms']:.0f} ms (target < {TARGET_MS:.0f} ms "
              f"with {args.live} sessions while the file runs)")
    span = s["file_span_push_ms"]
    if span["n"]:
        print(f"live pushes sent while the file ran ({s['file_span_s'][0]:.1f}-{s['file_span_s'][1]:.1f} s): "
              f"{span['n']}, p95 {span['p95']:.0f} ms, max {span['max']:.0f} ms")


def plot(s: dict, metrics: list[dict], samples: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    m = s["live_minutes"]
    x = [r["minute"] + 0.5 for r in m]  # a minute's figures at its middle, over its samples
    a.scatter([at / 60 for at, _ in samples], [1e3 * lat for _, lat in samples], s=2, color="lightgray",
              label="each sample")
    a.plot(x, [r["p50_ms"] for r in m], "o-", label="p50 per minute")
    a.plot(x, [r["p95_ms"] for r in m], "s-", label="p95 per minute")
    a.axhline(TARGET_MS, color="red", ls="--", lw=1, label=f"target {TARGET_MS:.0f} ms")
    a.set_xlabel("minute of the run (by send time)")
    a.set_ylabel("live push latency (ms)")
    a.set_yscale("log")
    a.set_title("live: 100 ms message sent -> progress event")
    a.legend(fontsize=8)
    rows = [r for r in metrics if "qasr_engine_kv_tokens_used" in r]
    t = [r["t_s"] for r in rows]
    total = max((r.get("qasr_engine_kv_tokens_total", 0) for r in rows), default=0)
    b.plot(t, [r["qasr_engine_kv_tokens_used"] for r in rows], label=f"KV tokens used (of {total:,.0f})")
    b.axvspan(*s["file_span_s"], color="orange", alpha=0.15, label="the file's request")
    b.set_xlabel("seconds of the run")
    b.set_ylabel("KV tokens")
    c = b.twinx()
    c.plot(t, [r.get("qasr_engine_running_requests", 0) for r in rows], color="green", lw=0.8, label="running")
    c.plot(t, [r.get("qasr_engine_waiting_requests", 0) for r in rows], color="purple", lw=0.8, label="waiting")
    c.set_ylabel("requests")
    b.legend(loc="upper left", fontsize=8)
    c.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_meta(args: argparse.Namespace) -> dict:
    from qasr.bench.perf.machine import cpu_info

    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src/qasr/engine"], cwd=ROOT, check=False)
    return {"model": args.model, "dtype": args.dtype, "device": args.device, "cpu": cpu_info()["model"],
            "commit": git_commit(), "engine_uncommitted_changes": dirty.returncode != 0,
            "machine": platform.platform(), "python": platform.python_version()}


def server_status_counts(before: dict, after: dict) -> dict[str, int]:
    out = {}
    for key, value in after.items():
        if key.startswith("qasr_http_requests_total{") and 'route="/v1/audio/transcriptions"' in key:
            status = key.split('status="', 1)[1].split('"', 1)[0]
            out[status] = int(value - before.get(key, 0.0))
    return out


def main_mixed(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    audio = make_audio(args)
    meta = machine_meta(args)
    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--live-max-backlog-s", "0.4") if args.ack_every_message else ()
        proc, url = start_server(args.model, args.device, args.dtype, Path(tmp) / "serve.log", *extra)
        try:
            print(f"warm-up: {asyncio.run(warm_up(url, audio, args)):.1f} s", flush=True)
            ref = asyncio.run(alone(url, audio, args))
            before = scrape(url)
            print(f"mixed run: {args.live} live sessions for {args.live_seconds:g} s ...", flush=True)
            run = asyncio.run(mixed(url, audio, args))
            counts = server_status_counts(before, scrape(url))
        finally:
            proc.terminate()
            proc.wait(60)
    meta["alone_file_latency_s"] = ref["file_latency_s"]
    meta["wall_s"] = time.perf_counter() - started
    s = summarize(run, ref, audio, args, counts)
    gauges = engine_gauges(run["metrics"])
    report(s, gauges, args, meta)
    stem = args.out / ("mixed_load_quick" if args.quick else "mixed_load")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"meta": meta, "settings": settings, "summary": s, "engine_gauges": gauges,
              "metrics": run["metrics"], "http_requests": [{k: v for k, v in h.items() if k != "text"}
                                                          for h in run["http"]]}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot(s, run["metrics"], s.pop("samples"), stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')} ({meta['wall_s']:.0f} s in all)")
    return 0 if not s["mismatches"] and s["nothing_lost"] else 1


# ---------------------------------------------------------------------------------------------- concurrency gain

def main_gain(args: argparse.Namespace) -> int:
    from qasr import ASR
    from qasr.engine.config import EngineConfig, EngineStats

    args.out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("qasr.transcribe.asr").setLevel(logging.ERROR)  # the random checkpoint runs to its cap
    track = cached_track(args.cache, "gain", 120.0, args.seed + 7)
    clips = [track[(k % 4) * 30 * SR:((k % 4) + 1) * 30 * SR] for k in range(args.gain_requests)]
    kv_bytes = int(args.kv_gib * 2**30)
    asr = ASR.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                              engine=EngineConfig(kv_cache_bytes=kv_bytes), max_in_flight_s=1e9)
    try:
        asr.transcribe(clips[0][:2 * SR], sample_rate=SR, language=args.language)  # warm-up
        series, stop = [], threading.Event()

        def poll() -> None:
            while not stop.is_set():
                series.append((time.perf_counter(), dataclasses.asdict(asr._core.engine.stats())))
                time.sleep(0.01)

        poller = threading.Thread(target=poll, daemon=True)
        t0 = time.perf_counter()
        poller.start()
        results = asr.transcribe(clips, TranscribeOptions(sample_rate=SR, segmentation="none"), language=args.language)
        wall = time.perf_counter() - t0
        stop.set()
        poller.join()
        final = dataclasses.asdict(asr._core.engine.stats())
    finally:
        asr.close()
    peak_running = max(s["running"] for _, s in series)
    peak_kv = max(s["kv_tokens_used"] for _, s in series)
    at_peak = next(s for _, s in series if s["running"] == peak_running)
    meta = machine_meta(args)
    out = {"meta": meta, "mode": "concurrency_gain", "kv_gib": args.kv_gib, "kv_cache_bytes": kv_bytes,
           "requests": args.gain_requests, "audio_s_each": 30.0, "wall_s": wall,
           "engine_stats_fields": [f.name for f in dataclasses.fields(EngineStats)],
           "peak_running": peak_running, "peak_kv_tokens_used": peak_kv, "kv_tokens_total": final["kv_tokens_total"],
           "stats_at_peak_running": at_peak, "stats_after": final,
           "tokens_generated": final["generated_tokens"] - series[0][1]["generated_tokens"],
           "finish_reasons": sorted({seg.finish_reason for r in results for seg in r.segments}),
           "series": [{"t_s": round(t - t0, 3), **s} for t, s in series[::10]]}
    print(f"\n{meta['cpu']}, commit {meta['commit']}, model {args.model}, {args.dtype}; KV budget {args.kv_gib:g} GiB "
          f"= {final['kv_tokens_total']} tokens; {args.gain_requests} requests of 30 s at once")
    print(f"most running at once: {peak_running} (waiting then: {at_peak['waiting']}), most KV tokens used: {peak_kv} "
          f"of {final['kv_tokens_total']}; all done in {wall:.1f} s; stats fields: {out['engine_stats_fields']}")
    path = args.out / f"mixed_load_gain_{meta['commit']}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return main_gain(args) if args.concurrency_gain else main_mixed(args)


if __name__ == "__main__":
    raise SystemExit(main())
