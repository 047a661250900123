"""What the benchmark modes share: seeded clips, peak memory, the reference, a closed-loop driver."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import torch

from qasr.bench.perf.report import machine_line

TOKENS_PER_SECOND = 4
SR = 16000
CONTENDED = 0.1  # others' CPU share above which figures get a warning


def clip_lengths(n: int, seed: int, lo: float = 2.0, hi: float = 120.0) -> list[float]:
    """n lengths in seconds, log-uniform over [lo, hi] (stratified, shuffled, to the centisecond)."""
    rng = np.random.default_rng(seed)
    edges = np.geomspace(lo, hi, n + 1)
    lengths = [round(float(np.exp(rng.uniform(np.log(edges[i]), np.log(edges[i + 1])))), 2) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def make_clip(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * SR))).astype(np.float32)


class PeakRss:
    """Peak resident memory over a phase (docs/log: bench-peak-rss)."""

    def __init__(self) -> None:
        self.peak = 0

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _vm_hwm() or _ru_maxrss()


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _ru_maxrss() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def build_checkpoint(cache_dir: Path) -> Path:
    from qasr.testing import QWEN3_ASR_0_6B_DIMS, make_tiny_checkpoint

    path = cache_dir / "qwen3-asr-0.6b-dims-random-hf"
    if not (path / "model.safetensors").exists():
        print(f"building a random checkpoint with the real 0.6B dimensions in {path} ...", flush=True)
        make_tiny_checkpoint(path, layout="hf", seed=0, dtype=torch.bfloat16, std=0.02, **QWEN3_ASR_0_6B_DIMS)
    return path


class ReferenceGenerate:
    """transformers' generate, each row forced to the batch's mean of TOKENS_PER_SECOND tokens per audio
    second; returns the tokens generated."""

    def __init__(self, ckpt_dir: Path, device: str = "cpu") -> None:
        import transformers
        from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

        from qasr.model.prompt import SpecialTokens
        from qasr.model.tokenizer import Tokenizer

        self.device = device
        model = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(ckpt_dir, dtype=torch.bfloat16)
        self.model = model.to(device).eval()
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        self.tok = Tokenizer.from_dir(ckpt_dir)
        self.special = SpecialTokens.resolve(self.tok, cfg["audio_token_id"])
        self.fe = Qwen3ASRFeatureExtractor()
        self.pad_id = cfg.get("pad_token_id", self.special.im_end)
        self.kw = dict(sampling_rate=SR, padding=True, truncation=False, return_attention_mask=True,
                       return_tensors="pt", device=device)

    def __call__(self, waves: list[np.ndarray]) -> int:
        from qasr.model.config import audio_token_count
        from qasr.model.prompt import build_prompt

        dev = self.device
        feats = self.fe(waves, **self.kw)
        mask = feats["attention_mask"]
        prompts = [build_prompt(self.tok, self.special, audio_token_count(int(m.sum()))) for m in mask]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        n_new = max(1, round(statistics.mean(TOKENS_PER_SECOND * len(w) / SR for w in waves)))
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev),
                                      input_features=feats["input_features"].to(dev, torch.bfloat16),
                                      input_features_mask=mask.to(dev), do_sample=False, max_new_tokens=n_new,
                                      min_new_tokens=n_new)
        return (out.shape[1] - width) * len(waves)


def closed_loop(submit: Callable[[int], Future], lengths: Sequence[float], concurrency: int,
                budget_s: float | None = None) -> dict:
    """``concurrency`` clients, each submitting when its previous request is done, until all are done or the
    budget is spent; figures over completed requests."""
    lock = threading.Lock()
    t0 = time.perf_counter()
    deadline = math.inf if budget_s is None else t0 + budget_s
    state = dict(next=0)
    done: list[tuple[int, object, float]] = []
    running: dict[int, Future] = {}
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                k = state["next"]
                if k >= len(lengths) or time.perf_counter() >= deadline:
                    return
                state["next"] = k + 1
            try:
                future = submit(k)
            except Exception as exc:  # noqa: BLE001
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                running[k] = future
            try:
                result = future.result(timeout=None if budget_s is None else max(0.0, deadline - time.perf_counter()))
            except (FutureTimeout, CancelledError):
                return
            except Exception as exc:  # noqa: BLE001
                with lock:
                    errors.append(repr(exc))
                    running.pop(k, None)
                continue
            with lock:
                running.pop(k, None)
                done.append((k, result, time.perf_counter()))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(max(1, concurrency))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with lock:
        left = list(running.values())
    for future in left:
        future.cancel()
    partial = len(done) < len(lengths)
    end = time.perf_counter() if partial else max(t for _, _, t in done)
    wall = max(end - t0, 1e-9)
    audio = sum(lengths[k] for k, _, _ in done)
    ttft = [r.ttft_s for _, r, _ in done]
    latency = [r.latency_s for _, r, _ in done]
    return dict(concurrency=concurrency, requests=len(lengths), completed=len(done), partial=partial,
                cancelled=len(left), errors=errors[:5], error_count=len(errors), wall_s=wall, audio_s=audio,
                rtfx=audio / wall, tokens=sum(len(r.token_ids) for _, r, _ in done),
                ttft_p50_s=percentile(ttft, 0.5), ttft_p95_s=percentile(ttft, 0.95),
                latency_p50_s=percentile(latency, 0.5), latency_p95_s=percentile(latency, 0.95),
                rtf_mean=statistics.mean(r.latency_s / lengths[k] for k, r, _ in done) if done else math.nan)


def _set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def in_subprocess(fn: Callable, threads: int, *args: object) -> dict:
    """``fn(*args)`` in a fresh spawned process with ``threads`` torch threads."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_set_threads,
                             initargs=(threads,)) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as exc:
            raise RuntimeError(f"{fn.__name__} failed: its process ended without an answer") from exc
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"{fn.__name__} failed: {exc!r}") from exc


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for an empty list."""
    return float(np.quantile(values, q, method="inverted_cdf")) if len(values) else math.nan


def save_report(report: dict, out: Path, stem: str, plot: Callable[[dict, Path], None], machine: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{stem}.png")
    print()
    print(machine_line(machine))
    print()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, device: str, dtype: str, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``qasr serve`` on a free port; the process and its URL once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "qasr", "serve", "-m", model, "--device", device, "--dtype", dtype,
           "--port", str(port), "--log-level", "warning", "--max-queue-audio-s", "1e9", *extra]
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
