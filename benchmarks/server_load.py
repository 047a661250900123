"""qasr serve under load: N concurrent HTTP clients against the same workload through the Python API.

Every side runs in this one invocation on the same model and the same clips (espeak-ng sentences):

* ``http``: ``qasr serve`` in a subprocess; ``--clients`` threads share one keep-alive ``httpx.Client`` (as
  an application shares one OpenAI client) and each sends requests (multipart upload, response_format json)
  until ``--requests`` are done;
* ``stream``: the same with ``stream=true`` (server-sent events), which also gives the time to the first
  delta (TTFT, from the start of the upload);
* ``api``: the same ``--clients`` threads calling ``ASR.transcribe`` on the same files, in this process
  (no HTTP, no upload).

The machine's speed drifts (a shared host can change by 2x within an hour), so the sides alternate in
``--rounds`` rounds (http, stream, api, http, stream, api, ...) with the server and the in-process model
both loaded (each idles while the other works); the table gives each side's median round and the ratio
of throughputs per round. The ratio http/api is what HTTP, multipart parsing and per-request decoding cost.

By default the model is a random checkpoint with the real Qwen3-ASR-0.6B dimensions (bf16), built once
and cached, whose LM head keeps only the rows of whole-word tokens (``benchmarks/streaming.py``'s
``words`` checkpoint): greedy decoding then picks a word at every step and never EOS, so every request
generates up to its cap (the same on every side) and its text is words, which the stream side sends as
deltas as they come (a plain random head mostly picks ids that decode to nothing, and a stream of nothing
costs the server less than a real one).

    .venv/bin/python benchmarks/server_load.py [--clients 64] [--requests 128] [--rounds 2] [--model DIR]
    .venv/bin/python benchmarks/server_load.py --model models/qasr-demo-en --dtype float32 --clients 2 \
        --requests 8 --rounds 1   # a smoke run

Prints a table, writes JSON and a PNG to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import httpx
import numpy as np
import psutil
import soundfile as sf

from qasr.bench.common import start_server
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "turn off the lights",
             "what is the weather", "play some music", "remind me at nine", "how much is twelve plus nine",
             "the meeting is on the fourth of march at three")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: a random checkpoint with the real 0.6B dimensions that "
                        "speaks words)")
    p.add_argument("--language", default="English",
                   help="forced on every side (default English): the prompt then ends in <asr_text>, so a random "
                        "checkpoint's tokens are text from the first one and the stream side's TTFT means something")
    p.add_argument("--clients", type=int, default=64, help="concurrent HTTP clients (default 64)")
    p.add_argument("--requests", type=int, default=128, help="requests per side and round (default 128)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of http, stream, api (default 2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    if args.model is None:
        from qasr.testing import QWEN3_ASR_0_6B_DIMS
        from qasr.testing.speaking import speaking_checkpoint

        args.cache.mkdir(parents=True, exist_ok=True)  # the same cache entry as benchmarks/streaming.py's
        args.model = str(speaking_checkpoint(args.cache / "streaming-0.6b-dims-random-words-hf",
                                             dict(QWEN3_ASR_0_6B_DIMS), "words"))
    return args


def make_clips(folder: Path, n: int) -> list[Path]:
    return [speak(SENTENCES[k % len(SENTENCES)], folder / f"clip{k:03d}.wav", speed=140 + 5 * (k % 9))
            for k in range(n)]


def one_request(client: httpx.Client, url: str, path: Path, stream: bool, language: str) -> dict:
    started = time.perf_counter()
    try:
        return _request(client, url, path, stream, language, started)
    except httpx.HTTPError as exc:  # counted, not fatal: the table reports errors
        return {"latency_s": time.perf_counter() - started, "first_delta_s": None, "text": None,
                "error": f"{type(exc).__name__}: {exc}"}


def _request(client: httpx.Client, url: str, path: Path, stream: bool, language: str, started: float) -> dict:
    with path.open("rb") as upload:  # closed after the request, not left to the garbage collector
        return _send(client, url, upload, stream, language, started)


def _send(client: httpx.Client, url: str, upload: BinaryIO, stream: bool, language: str, started: float) -> dict:
    first = None
    if stream:
        with client.stream("POST", f"{url}/v1/audio/transcriptions", files={"file": upload},
                           data={"stream": "true", "language": language}) as r:
            r.raise_for_status()
            text = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if first is None:
                        first = time.perf_counter() - started
                    if event["type"] == "transcript.text.done":
                        text = event["text"]
    else:
        r = client.post(f"{url}/v1/audio/transcriptions", files={"file": upload},
                        data={"language": language})
        r.raise_for_status()
        text = r.json()["text"]
    return {"latency_s": time.perf_counter() - started, "first_delta_s": first, "text": text, "error": None}


def ttft_buckets(url: str) -> dict[float, float]:
    """The server's engine time-to-first-token histogram: cumulative count per bucket bound."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("qasr_time_to_first_token_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of the requests between two scrapes."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    for bound in sorted(after):
        if after[bound] - before.get(bound, 0.0) >= q * total:
            return bound
    return float("inf")


def run_http(url: str, server: psutil.Process, clips: list[Path], args: argparse.Namespace, stream: bool) -> dict:
    paths = [clips[k % len(clips)] for k in range(args.requests)]
    histogram = ttft_buckets(url)
    # One client with a keep-alive pool for all threads, as an application holds one OpenAI client: a new
    # httpx.Client per request builds an SSL context each time (about 20-40 ms of CPU here), which on a
    # 2-core machine shared with the server is client cost, not the server's HTTP overhead.
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    cpu = CpuMeter(server)
    started = time.perf_counter()
    with httpx.Client(timeout=600, limits=limits) as client, ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda p: one_request(client, url, p, stream, args.language), paths))
    wall = time.perf_counter() - started
    cpu_s = cpu.seconds()
    histogram_after = ttft_buckets(url)
    audio = sum(sf.info(p).duration for p in paths)
    lat = np.array([r["latency_s"] for r in results])
    out = {"requests": len(paths), "audio_s": audio, "wall_s": wall, "rtfx": audio / wall,
           "errors": [r["error"] for r in results if r["error"]],
           "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
           "p99_s": float(np.percentile(lat, 99)), "latencies_s": lat.tolist(),
           "texts": [r["text"] for r in results], **cpu_s}
    # the engine's own first-token times (submit to first token), at the resolution of the histogram's buckets
    out["engine_ttft_p50_le_s"] = bucket_quantile(histogram, histogram_after, 0.5)
    out["engine_ttft_p95_le_s"] = bucket_quantile(histogram, histogram_after, 0.95)
    if stream:  # the first delta as the client sees it; none before the end when the text is empty
        firsts = [r["first_delta_s"] for r in results if r["first_delta_s"] is not None]
        out["first_delta_p50_s"] = float(np.percentile(firsts, 50))
        out["first_delta_p95_s"] = float(np.percentile(firsts, 95))
    return out


def run_api(asr, server: psutil.Process, clips: list[Path], args: argparse.Namespace) -> dict:  # noqa: ANN001
    """The same requests through the Python API: ``--clients`` threads each calling ``transcribe`` on one
    file at a time (the HTTP side's arrival pattern, so the ratio is HTTP's own cost)."""
    paths = [str(clips[k % len(clips)]) for k in range(args.requests)]
    cpu = CpuMeter(server)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda p: asr.transcribe(p, language=args.language)[0], paths))
    wall = time.perf_counter() - started
    audio = sum(r.duration for r in results)
    return {"requests": len(paths), "audio_s": audio, "wall_s": wall, "rtfx": audio / wall, "errors": [],
            "texts": [r.text for r in results], **cpu.seconds()}


SIDES = ("http", "stream", "api")


class CpuMeter:
    """CPU seconds used by this process (the clients, or the in-process API's engine) and by the server
    process over one side's run, and what the rest of the machine used meanwhile (other processes)."""

    def __init__(self, server: psutil.Process) -> None:
        self.server, self.me = server, psutil.Process()
        self.start = (self._used(self.me), self._used(server), psutil.cpu_times())

    @staticmethod
    def _used(proc: psutil.Process) -> float:
        t = proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def seconds(self) -> dict[str, float]:
        me, server, machine = self._used(self.me), self._used(self.server), psutil.cpu_times()
        busy = sum(getattr(machine, f) - getattr(self.start[2], f) for f in ("user", "system", "nice")) \
            + sum(getattr(machine, f, 0.0) - getattr(self.start[2], f, 0.0) for f in ("irq", "softirq"))
        mine, theirs = me - self.start[0], server - self.start[1]
        return {"bench_cpu_s": mine, "server_cpu_s": theirs, "other_cpu_s": max(0.0, busy - mine - theirs)}


def median_round(rounds: list[dict], side: str) -> dict:
    walls = [r[side]["wall_s"] for r in rounds]
    return rounds[int(np.argsort(walls)[len(walls) // 2])][side]


def report(rounds: list[dict], args: argparse.Namespace) -> dict:
    from qasr.bench.perf.machine import cpu_info

    print(f"{cpu_info()['model']}, model {args.model}, {args.dtype}, {args.clients} clients, "
          f"{args.requests} requests per side, {len(rounds)} rounds (median round shown)")
    print(f"{'side':<7} {'errors':>6} {'audio s':>8} {'wall s':>7} {'req/s':>6} {'RTFx':>6} "
          f"{'p50 s':>7} {'p95 s':>7} {'p99 s':>7} {'1st delta p50/p95':>18} {'engine TTFT p50/p95':>20} "
          f"{'CPU s bench/server/other':>25}")
    medians = {side: median_round(rounds, side) for side in SIDES}
    for side, m in medians.items():
        lat = [f"{m[k]:>7.2f}" if k in m else f"{'-':>7}" for k in ("p50_s", "p95_s", "p99_s")]
        first = f"{m['first_delta_p50_s']:.2f} / {m['first_delta_p95_s']:.2f}" if "first_delta_p50_s" in m else "-"
        engine = f"<={m['engine_ttft_p50_le_s']:g} / <={m['engine_ttft_p95_le_s']:g}" if "engine_ttft_p50_le_s" in m \
            else "-"
        print(f"{side:<7} {len(m['errors']):>6} {m['audio_s']:>8.1f} {m['wall_s']:>7.1f} "
              f"{m['requests'] / m['wall_s']:>6.2f} {m['rtfx']:>6.2f} {' '.join(lat)} {first:>18} {engine:>20} "
              f"{m['bench_cpu_s']:>9.1f}/{m['server_cpu_s']:.1f}/{m['other_cpu_s']:.1f}")
    ratios = [r["http"]["rtfx"] / r["api"]["rtfx"] for r in rounds]
    stream_ratios = [r["stream"]["rtfx"] / r["api"]["rtfx"] for r in rounds]
    same = all(r[s]["texts"] == rounds[0]["api"]["texts"] for r in rounds for s in SIDES)
    print("per round, throughput http/api: " + ", ".join(f"{x:.3f}" for x in ratios)
          + "; stream/api: " + ", ".join(f"{x:.3f}" for x in stream_ratios) + f"; same texts on every side: {same}")
    return {"http_over_api": ratios, "stream_over_api": stream_ratios, "same_texts": same}


def plot(rounds: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(rounds)
    for k, r in enumerate(rounds):
        a.bar(np.arange(len(SIDES)) + k * width, [r[s]["rtfx"] for s in SIDES], width, label=f"round {k + 1}")
    a.set_xticks(np.arange(len(SIDES)) + width * (len(rounds) - 1) / 2, ["HTTP json", "HTTP stream", "Python API"])
    a.set_ylabel("audio seconds per wall second (RTFx)")
    a.set_title(f"{args.clients} clients, {args.requests} requests per side")
    a.legend(loc="lower right")
    last = rounds[-1]
    b.hist([last["http"]["latencies_s"], last["stream"]["latencies_s"]], bins=30, label=["json", "stream"])
    b.set_xlabel("HTTP request latency (s), last round")
    b.set_ylabel("requests")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # every request of the default checkpoint runs to its cap by design (it never picks EOS): the API's
    # "cut at max_new_tokens" warning would print once per request on that side
    logging.getLogger("qasr.transcribe.asr").setLevel(logging.ERROR)
    from qasr import ASR

    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        clips = make_clips(Path(tmp), min(args.requests, 24))
        proc, url = start_server(args.model, args.device, args.dtype, Path(tmp) / "serve.log")
        server = psutil.Process(proc.pid)
        asr = ASR.from_pretrained(args.model, device=args.device, dtype=args.dtype)
        try:
            asr.transcribe(str(clips[0]), language=args.language)  # warm-up, as the server does before it reports ready
            for k in range(args.rounds):
                r = {"http": run_http(url, server, clips, args, stream=False),
                     "stream": run_http(url, server, clips, args, stream=True),
                     "api": run_api(asr, server, clips, args)}
                print(f"round {k + 1}: " + ", ".join(f"{s} {r[s]['wall_s']:.1f} s" for s in SIDES), flush=True)
                rounds.append(r)
        finally:
            asr._core.engine.close(drain=False, timeout=30)
            proc.terminate()
            proc.wait(60)
    summary = report(rounds, args)
    stem = args.out / f"server_load_c{args.clients}"
    from qasr.bench.perf.machine import cpu_info

    meta = {"model": args.model, "language": args.language, "clients": args.clients, "requests": args.requests,
            "rounds": args.rounds,
            "device": args.device, "dtype": args.dtype, "cpu": cpu_info()["model"], "machine": platform.platform(),
            "python": platform.python_version()}
    result = {"meta": meta, "summary": summary, "rounds": rounds}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rounds, args, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
