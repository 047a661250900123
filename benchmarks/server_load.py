"""qasr serve under load: N concurrent HTTP clients against the same workload through the Python API.

Both sides run in this one invocation on the same model and the same clips (espeak-ng sentences):

* ``http``: ``qasr serve`` in a subprocess; ``--clients`` threads each send requests (multipart upload,
  response_format json, or streamed with ``--stream``) until ``--requests`` are done;
* ``api``: ``ASR.transcribe`` on the same files in one call, in this process (no HTTP, no upload).

The ratio of their throughputs is what HTTP, multipart parsing and per-request decoding cost. Latency
percentiles are per HTTP request (upload to last byte); with ``--stream`` the time to the first delta too.

By default the model is a random checkpoint with the real Qwen3-ASR-0.6B dimensions (bf16), built once
and cached: random weights rarely end a text early, so every request generates up to its cap, the same
on both sides.

    .venv/bin/python benchmarks/server_load.py [--clients 64] [--requests 256] [--stream] [--model DIR]
    .venv/bin/python benchmarks/server_load.py --model models/qasr-demo-en --dtype float32 --clients 2 \
        --requests 8    # a smoke run

Prints a table, writes JSON and a PNG to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "turn off the lights",
             "what is the weather", "play some music", "remind me at nine", "how much is twelve plus nine",
             "the meeting is on the fourth of march at three")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: a random checkpoint with the real 0.6B dimensions)")
    p.add_argument("--clients", type=int, default=64, help="concurrent HTTP clients (default 64)")
    p.add_argument("--requests", type=int, default=256, help="HTTP requests in all (default 256)")
    p.add_argument("--stream", action="store_true", help="stream=true requests (adds time to first delta)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    if args.model is None:
        from qasr.bench import build_checkpoint

        args.cache.mkdir(parents=True, exist_ok=True)
        args.model = str(build_checkpoint(args.cache))
    return args


def make_clips(folder: Path, n: int) -> list[Path]:
    return [speak(SENTENCES[k % len(SENTENCES)], folder / f"clip{k:03d}.wav", speed=140 + 5 * (k % 9))
            for k in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "qasr", "serve", "-m", args.model, "--device", args.device, "--dtype", args.dtype,
           "--port", str(port), "--log-level", "warning", "--max-queue-audio-s", "1e9"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"qasr serve exited: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise TimeoutError("qasr serve did not become ready")


def one_request(url: str, path: Path, stream: bool) -> dict:
    started = time.perf_counter()
    first = None
    try:
        return _request(url, path, stream, started)
    except httpx.HTTPError as exc:  # counted, not fatal: the table reports errors
        return {"latency_s": time.perf_counter() - started, "first_delta_s": first, "text": None,
                "error": f"{type(exc).__name__}: {exc}"}


def _request(url: str, path: Path, stream: bool, started: float) -> dict:
    first = None
    with httpx.Client(timeout=600) as client:
        if stream:
            with client.stream("POST", f"{url}/v1/audio/transcriptions", files={"file": path.open("rb")},
                               data={"stream": "true"}) as r:
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
            r = client.post(f"{url}/v1/audio/transcriptions", files={"file": path.open("rb")})
            r.raise_for_status()
            text = r.json()["text"]
    return {"latency_s": time.perf_counter() - started, "first_delta_s": first, "text": text, "error": None}


def run_http(url: str, clips: list[Path], args: argparse.Namespace) -> dict:
    paths = [clips[k % len(clips)] for k in range(args.requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda p: one_request(url, p, args.stream), paths))
    wall = time.perf_counter() - started
    audio = sum(sf.info(p).duration for p in paths)
    lat = np.array([r["latency_s"] for r in results])
    out = {"requests": len(paths), "audio_s": audio, "wall_s": wall, "rtfx": audio / wall,
           "requests_per_s": len(paths) / wall, "errors": [r["error"] for r in results if r["error"]],
           "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
           "p99_s": float(np.percentile(lat, 99)), "latencies_s": lat.tolist(), "texts": [r["text"] for r in results]}
    if args.stream:
        firsts = [r["first_delta_s"] for r in results if r["first_delta_s"] is not None]
        out["first_delta_p50_s"] = float(np.percentile(firsts, 50))
        out["first_delta_p95_s"] = float(np.percentile(firsts, 95))
    return out


def run_api(clips: list[Path], args: argparse.Namespace) -> tuple[dict, dict]:
    """The same requests through the Python API, twice: ``--clients`` threads each calling
    ``transcribe`` on one file at a time (the HTTP side's arrival pattern, so the ratio is HTTP's own
    cost), then all files in one ``transcribe`` call (a burst: a different schedule for the engine)."""
    from qasr import ASR

    asr = ASR.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    paths = [str(clips[k % len(clips)]) for k in range(args.requests)]
    try:
        asr.transcribe(str(clips[0]))  # warm-up, as the server does before it reports ready
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            looped = list(pool.map(lambda p: asr.transcribe(p)[0], paths))
        loop_wall = time.perf_counter() - started
        started = time.perf_counter()
        burst = asr.transcribe(paths)
        burst_wall = time.perf_counter() - started
    finally:
        asr.engine.close(drain=False, timeout=30)
    audio = sum(r.duration for r in looped)
    return ({"requests": len(paths), "audio_s": audio, "wall_s": loop_wall, "rtfx": audio / loop_wall,
             "texts": [r.text for r in looped]},
            {"requests": len(paths), "audio_s": audio, "wall_s": burst_wall, "rtfx": audio / burst_wall,
             "texts": [r.text for r in burst]})


def report(http: dict, api: dict, burst: dict, args: argparse.Namespace) -> None:
    from qasr.perf.machine import cpu_info

    print(f"{cpu_info()['model']}, model {args.model}, {args.dtype}, {args.clients} clients")
    print(f"{'mode':<6} {'requests':>8} {'errors':>6} {'audio s':>9} {'wall s':>8} {'req/s':>7} {'RTFx':>7} "
          f"{'p50 s':>7} {'p95 s':>7} {'p99 s':>7}")
    print(f"{'http':<6} {http['requests']:>8} {len(http['errors']):>6} {http['audio_s']:>9.1f} {http['wall_s']:>8.2f} "
          f"{http['requests_per_s']:>7.2f} {http['rtfx']:>7.1f} {http['p50_s']:>7.3f} {http['p95_s']:>7.3f} "
          f"{http['p99_s']:>7.3f}")
    for name, side in (("api", api), ("burst", burst)):
        print(f"{name:<6} {side['requests']:>8} {0:>6} {side['audio_s']:>9.1f} {side['wall_s']:>8.2f} "
              f"{side['requests'] / side['wall_s']:>7.2f} {side['rtfx']:>7.1f} {'-':>7} {'-':>7} {'-':>7}")
    print("api: the same clients through ASR.transcribe (no HTTP); burst: every file in one transcribe call")
    same = http["texts"] == api["texts"] == burst["texts"]
    overhead = 1 - http["rtfx"] / api["rtfx"]
    print(f"clients={args.clients} http/api throughput={http['rtfx'] / api['rtfx']:.3f} "
          f"(HTTP overhead {overhead:.1%}) same_texts={same}")
    if "first_delta_p50_s" in http:
        print(f"time to first delta: p50 {http['first_delta_p50_s']:.3f} s, p95 {http['first_delta_p95_s']:.3f} s")


def plot(http: dict, api: dict, burst: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(["http", "api (same clients)", "api (one call)"], [http["rtfx"], api["rtfx"], burst["rtfx"]],
          color=["tab:blue", "tab:gray", "silver"])
    a.set_ylabel("audio seconds per wall second (RTFx)")
    a.set_title(f"{args.clients} HTTP clients vs the Python API")
    b.hist(http["latencies_s"], bins=30, color="tab:blue")
    b.set_xlabel("HTTP request latency (s)")
    b.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        clips = make_clips(Path(tmp), min(args.requests, 24))
        proc, url = start_server(args, Path(tmp) / "serve.log")
        try:
            http = run_http(url, clips, args)
        finally:
            proc.terminate()
            proc.wait(60)
        api, burst = run_api(clips, args)
    report(http, api, burst, args)
    stem = args.out / f"server_load_c{args.clients}{'_stream' if args.stream else ''}"
    from qasr.perf.machine import cpu_info

    meta = {"model": args.model, "clients": args.clients, "stream": args.stream, "device": args.device,
            "dtype": args.dtype, "cpu": cpu_info()["model"], "machine": platform.platform(),
            "python": platform.python_version()}
    result = {"meta": meta, "http": http, "api": api, "burst": burst}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(http, api, burst, args, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
