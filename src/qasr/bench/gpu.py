"""GPU mode of the throughput benchmark (``qasr bench --device cuda``), measured as the official figures
were (docs/benchmarks.md): ~2-minute clips from c closed-loop clients, on a random bf16 checkpoint with the
real 0.6B dimensions, against transformers' ``generate`` at batch 8 and 32. Each level has a time budget.
The last line is ``gpu_rtfx_c128=<x> ttft_p50_c1_ms=<y> speedup_vs_transformers=<z>``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.bench.common import (
    SR,
    TOKENS_PER_SECOND,
    ReferenceGenerate,
    build_checkpoint,
    closed_loop,
    in_subprocess,
    percentile,
)

CLIP_RANGE = (100.0, 140.0)  # the official protocol's ~2-minute clips
LEVELS = ((1, 3), (16, 32), (128, 128), (512, 512))  # (concurrency, requests)
LEVEL_BUDGETS_S = (20.0, 30.0, 45.0, 60.0)
REFERENCE_BATCHES = (8, 32)
DISTINCT_CLIPS = 64  # requests reuse these (sliced to each request's length): the content does not change the work


@dataclass(frozen=True)
class GpuPlan:
    levels: tuple[tuple[int, int], ...] = LEVELS
    level_budgets_s: tuple[float, ...] = LEVEL_BUDGETS_S
    clip_range: tuple[float, float] = CLIP_RANGE
    invariance_clips: int = 16
    invariance_range: tuple[float, float] = (5.0, 20.0)
    invariance_budget_s: float = 10.0
    reference_batches: tuple[int, ...] = REFERENCE_BATCHES
    reference_budget_s: float = 50.0
    seed: int = 0
    dtype: str = "bfloat16"
    kv_gib: float = 0.0  # 0: the engine's default share of the free GPU memory

    def __post_init__(self) -> None:
        if len(self.level_budgets_s) != len(self.levels):
            raise ValueError("one time budget per level")
        if any(b < 0 for b in self.level_budgets_s) or not any(b > 0 for b in self.level_budgets_s):
            raise ValueError("level budgets are >= 0 (0 skips a level), at least one > 0")
        lo, hi = self.clip_range
        if not 0 < lo <= hi:
            raise ValueError(f"bad clip range {self.clip_range}")


QUICK = GpuPlan(levels=((1, 2), (16, 16), (128, 128), (512, 512)), level_budgets_s=(15.0, 20.0, 30.0, 40.0),
                clip_range=(20.0, 40.0), invariance_clips=8, invariance_budget_s=8.0, reference_budget_s=30.0)


class FirstTokens:
    """Time to first token of every request a level submits, through ``on_token``: one still waiting
    at the level's end counts its wait so far (a lower bound), so the slowest starts stay in the p95."""

    def __init__(self) -> None:
        self.submitted: dict[int, float] = {}
        self.first: dict[int, float] = {}

    def submit(self, k: int, submit: Callable[[Callable[[int | None], None]], Future]) -> Future:
        """``submit(on_token)`` submits request k; its first token's time is recorded (on the engine thread)."""
        def on_token(token: int | None) -> None:
            if token is not None and k not in self.first:
                self.first[k] = time.perf_counter()

        self.submitted[k] = time.perf_counter()
        return submit(on_token)

    def summary(self, end: float) -> dict:
        """TTFT p50 / p95 over every request submitted before ``end`` (the level's end)."""
        ttft, waiting = [], 0
        for k, t0 in list(self.submitted.items()):
            first = self.first.get(k)
            if first is None or first > end:
                waiting += 1
                first = end
            ttft.append(first - t0)
        return dict(ttft_p50_s=percentile(ttft, 0.5), ttft_p95_s=percentile(ttft, 0.95), ttft_requests=len(ttft),
                    ttft_without_first_token=waiting)


def level_with_first_tokens(submit: Callable[[int, Callable[[int | None], None]], Future], lengths: list[float],
                            concurrency: int, budget_s: float) -> dict:
    """``closed_loop`` with TTFT over every submitted request; its own figures over completed requests
    stay as ``ttft_completed_p50_s`` / ``ttft_completed_p95_s``."""
    firsts = FirstTokens()
    level = closed_loop(lambda k: firsts.submit(k, lambda on_token: submit(k, on_token)), lengths, concurrency,
                        budget_s)
    end = time.perf_counter()
    level["ttft_completed_p50_s"], level["ttft_completed_p95_s"] = level["ttft_p50_s"], level["ttft_p95_s"]
    level.update(firsts.summary(end))
    return level


def lengths_for(n: int, seed: int, clip_range: tuple[float, float]) -> list[float]:
    """n clip lengths drawn uniformly from the range, seeded, to the centisecond."""
    rng = np.random.default_rng(seed)
    return [round(float(x), 2) for x in rng.uniform(*clip_range, size=n)]


def clip_pool(n: int, seconds: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [0.1 * rng.standard_normal(int(seconds * SR), dtype=np.float32) for _ in range(n)]


def gpu_engine_config(max_running: int, kv_bytes: int | None) -> object:
    """The engine's settings for a GPU: a whole 2-minute clip encoded and prefilled in one step beside the decode
    rows of ``max_running`` sequences decoding together."""
    from qasr.engine.engine import EngineConfig

    return EngineConfig(kv_cache_bytes=kv_bytes, max_running=max_running, step_tokens=120 * 104 + 16384 + max_running,
                        prefill_chunk=2048, conv_batch=256)


def _gpu_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return dict(peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                used_gib=(total - free) / 2**30, total_gib=total / 2**30)


def _write(path: Path | None, data: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))


# --- qasr side
def run_qasr_gpu(ckpt_dir: Path, plan: GpuPlan, device: str = "cuda", progress: Path | None = None) -> dict:
    """qasr's engine through the levels, then the batch-invariance check (``device="cpu"`` runs the
    same code on CPU tensors, for tests)."""
    from qasr.bench.perf.phases import timing_delta
    from qasr.engine.engine import Engine, RequestSpec
    from qasr.model.checkpoint import load_checkpoint
    from qasr.model.config import audio_token_count
    from qasr.model.prompt import build_prompt

    dev = torch.device(device)
    ck = load_checkpoint(ckpt_dir, device=device, dtype=plan.dtype)
    weights = sum(p.numel() * p.element_size() for p in ck.model.parameters())
    max_conc = max(c for (c, _), b in zip(plan.levels, plan.level_budgets_s, strict=True) if b > 0)
    kv = int(plan.kv_gib * 2**30) or None
    engine = Engine(ck, gpu_engine_config(max_conc, kv))
    hop = ck.features.hop_length
    pool = clip_pool(DISTINCT_CLIPS, max(plan.clip_range[1], plan.invariance_range[1]), plan.seed + 500)
    report: dict = dict(device=str(dev), backend=engine.prepared.description, dtype=plan.dtype,
                        weights_gib=weights / 2**30, kv_cache_gib=engine.core.pool.nbytes / 2**30,
                        kv_tokens=engine.core.pool.tokens, config=asdict(engine.config), levels={})

    def submit_clip(wave: np.ndarray, on_token: Callable[[int | None], None] | None = None) -> Future:
        prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // hop))
        return engine.submit(RequestSpec(prompt, max(1, round(TOKENS_PER_SECOND * len(wave) / SR)), waveform=wave,
                                         ignore_eos=True), on_token=on_token)

    def clip(k: int, seconds: float) -> np.ndarray:
        return pool[k % len(pool)][:int(seconds * SR)]

    def stats() -> dict:
        return engine.core.runner.stats() if hasattr(engine.core.runner, "stats") else {}

    try:
        t0 = time.perf_counter()
        # first kernels and cuBLAS heuristics on short and full-length shapes
        warm_s = [*lengths_for(3, plan.seed + 9, plan.invariance_range), plan.clip_range[0]]
        for f in [submit_clip(clip(k, s)) for k, s in enumerate(warm_s)]:
            f.result()
        report["warmup_s"] = time.perf_counter() - t0
        report["runner"] = stats()
        for i, ((conc, n), budget) in enumerate(zip(plan.levels, plan.level_budgets_s, strict=True)):
            if budget <= 0:
                report.setdefault("skipped_levels", []).append(conc)
                print(f"  qasr c={conc:4d}: skipped (budget 0)", flush=True)
                continue
            lengths = lengths_for(n, plan.seed + 100 + i, plan.clip_range)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            timings0, steps0, runner0 = dict(engine.timings), engine.steps, stats()
            level = level_with_first_tokens(
                lambda k, on_token, lengths=lengths: submit_clip(clip(k, lengths[k]), on_token), lengths, conc, budget)
            level.update(steps=engine.steps - steps0, phases=timing_delta(engine.timings, timings0),
                         memory=_gpu_memory(dev),
                         runner={k: v - runner0.get(k, 0) for k, v in stats().items() if isinstance(v, int | float)})
            report["levels"][str(conc)] = level
            waiting = level["ttft_without_first_token"]
            print(f"  qasr c={conc:4d}: {level['completed']}/{n} requests, {level['rtfx']:8.1f} audio-s/s, TTFT p50 "
                  f"{level['ttft_p50_s'] * 1e3:7.1f} ms p95 {level['ttft_p95_s'] * 1e3:7.1f} ms over "
                  f"{level['ttft_requests']} requests" + (f" ({waiting} without a first token: their wait so far)"
                                                          if waiting else "")
                  + (" (partial: time budget spent)" if level["partial"] else ""), flush=True)
            _write(progress, report)
        report["invariance"] = batch_invariance(submit_clip, plan)
        print(f"  qasr bf16 batch invariance: {report['invariance']['identical']}/{report['invariance']['compared']} "
              "requests identical in a batch and alone", flush=True)
        report["runner"] = stats()
        _write(progress, report)
    finally:
        engine.close(drain=False)
    return report


def batch_invariance(submit_clip: Callable[[np.ndarray], Future], plan: GpuPlan) -> dict:
    """The same clips together and one at a time: how many get identical tokens, and where others differ."""
    t0 = time.perf_counter()
    lengths = lengths_for(plan.invariance_clips, plan.seed + 77, plan.invariance_range)
    waves = clip_pool(len(lengths), max(lengths), plan.seed + 78)
    waves = [w[:int(s * SR)] for w, s in zip(waves, lengths, strict=True)]
    together = [f.result().token_ids for f in [submit_clip(w) for w in waves]]
    alone: list[list[int]] = []
    for w in waves:
        if time.perf_counter() - t0 > plan.invariance_budget_s:
            break
        alone.append(submit_clip(w).result().token_ids)
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                  for a, b in zip(together, alone, strict=False) if a != b]
    return dict(compared=len(alone), identical=sum(a == b for a, b in zip(together, alone, strict=False)),
                first_difference_at=first_diff, tokens_per_request=[len(t) for t in together[:len(alone)]],
                seconds=time.perf_counter() - t0)


# --- reference side
def run_reference_gpu(ckpt_dir: Path, plan: GpuPlan, device: str = "cuda", progress: Path | None = None) -> dict:
    """transformers' generate batched at each of ``plan.reference_batches``, within the budget: a batch
    starts only while the time spent plus the previous batch's time fits it."""
    dev = torch.device(device)
    generate = ReferenceGenerate(ckpt_dir, device=device)
    pool = clip_pool(DISTINCT_CLIPS, plan.clip_range[1], plan.seed + 500)
    report: dict = dict(device=str(dev), batches={})
    generate([pool[0][:int(plan.invariance_range[0] * SR)]])  # warm-up: loads the kernels (a short clip is enough)
    start = time.perf_counter()
    last_wall = 0.0
    for i, batch in enumerate(plan.reference_batches):
        lengths = sorted(lengths_for(batch, plan.seed + 200 + i, plan.clip_range))
        waves = [pool[k % len(pool)][:int(s * SR)] for k, s in enumerate(lengths)]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if time.perf_counter() - start + last_wall > plan.reference_budget_s:
            report["batches"][str(batch)] = dict(skipped="time budget spent")
            continue
        t0 = time.perf_counter()
        tokens = generate(waves)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall = last_wall = time.perf_counter() - t0
        report["batches"][str(batch)] = dict(batch=batch, wall_s=wall, audio_s=sum(lengths), rtfx=sum(lengths) / wall,
                                             tokens=tokens, memory=_gpu_memory(dev))
        print(f"  transformers generate, batch {batch:3d}: {sum(lengths) / wall:8.1f} audio-s/s "
              f"({wall:.1f} s for {len(lengths)} clips)", flush=True)
        _write(progress, report)
    return report


# --- machine
def gpu_probe(device: str = "cuda", n: int = 8192, copy_bytes: int = 2 << 30, repeats: int = 10) -> dict:
    """The GPU's name and measured ceilings: a bf16 n x n x n product (TFLOP/s) and a device-to-device
    copy (bytes per second); medians of ``repeats`` runs."""
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(copy_bytes // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def median_s(fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(times)

    mm = median_s(lambda: a @ b)
    cp = median_s(lambda: y.copy_(x))
    return dict(name=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                memory_gib=props.total_memory / 2**30, torch=torch.__version__, cuda=torch.version.cuda,
                bf16_matmul_tflops=2 * n**3 / mm / 1e12, copy_GBps=2 * copy_bytes / cp / 1e9)


# --- report
def speedup(report: dict) -> float:
    """qasr at concurrency 128 over transformers' best batch (NaN where either is missing)."""
    ours = report.get("qasr", {}).get("levels", {}).get("128", {}).get("rtfx", math.nan)
    ref = [b["rtfx"] for b in report.get("reference", {}).get("batches", {}).values() if "rtfx" in b]
    return ours / max(ref) if ref else math.nan


def summary_line(report: dict) -> str:
    levels = report.get("qasr", {}).get("levels", {})
    rtfx = levels.get("128", {}).get("rtfx", math.nan)
    ttft = levels.get("1", {}).get("ttft_p50_s", math.nan) * 1e3
    return f"gpu_rtfx_c128={rtfx:.1f} ttft_p50_c1_ms={ttft:.1f} speedup_vs_transformers={speedup(report):.2f}"


def table(report: dict) -> str:
    lines = ["| side | concurrency / batch | requests | audio-s/s | TTFT p50 ms | TTFT p95 ms | peak GPU GiB |",
             "|---|---|---|---|---|---|---|"]
    for conc, lv in report.get("qasr", {}).get("levels", {}).items():
        mem = lv.get("memory", {}).get("peak_allocated_gib", math.nan)
        lines.append(f"| qasr | c={conc} | {lv['completed']}/{lv['requests']}{' partial' if lv['partial'] else ''} | "
                     f"{lv['rtfx']:.1f} | {lv['ttft_p50_s'] * 1e3:.1f} | {lv['ttft_p95_s'] * 1e3:.1f} | {mem:.1f} |")
    for batch, b in report.get("reference", {}).get("batches", {}).items():
        if "rtfx" not in b:
            lines.append(f"| transformers generate | batch {batch} | - | {b.get('skipped', 'not run')} | | | |")
            continue
        mem = b.get("memory", {}).get("peak_allocated_gib", math.nan)
        lines.append(f"| transformers generate | batch {batch} | {batch} | {b['rtfx']:.1f} | | | {mem:.1f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report.get("qasr", {}).get("levels", {})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    conc = list(levels)
    a.plot([int(c) for c in conc], [levels[c]["rtfx"] for c in conc], "o-", label="qasr")
    for batch, r in report.get("reference", {}).get("batches", {}).items():
        if "rtfx" in r:
            a.axhline(r["rtfx"], ls="--", color="#999999")
            a.text(1, r["rtfx"], f"transformers batch {batch}", va="bottom", fontsize=8)
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrency (closed loop)")
    a.set_ylabel("audio seconds per wall second")
    a.legend()
    b.plot([int(c) for c in conc], [levels[c]["ttft_p50_s"] * 1e3 for c in conc], "o-", label="p50")
    b.plot([int(c) for c in conc], [levels[c]["ttft_p95_s"] * 1e3 for c in conc], "s--", label="p95")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("concurrency")
    b.set_ylabel("qasr time to first token (ms)")
    b.legend()
    fig.suptitle(report.get("title", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:  # noqa: ANN001 - the argparse namespace of qasr.bench.main
    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 2
    plan = QUICK if args.quick else GpuPlan()
    overrides = {}
    if args.gpu_budgets:
        overrides["level_budgets_s"] = tuple(float(x) for x in args.gpu_budgets.split(","))
    if args.gpu_reference_budget is not None:
        overrides["reference_budget_s"] = args.gpu_reference_budget
    if args.gpu_kv_gib:
        overrides["kv_gib"] = args.gpu_kv_gib
    plan = GpuPlan(**{**asdict(plan), **overrides, "seed": args.seed})
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "throughput_gpu_quick" if args.quick else "throughput_gpu"
    t0 = time.perf_counter()
    machine = gpu_probe()
    print(f"GPU: {machine['name']} (sm {machine['capability']}, {machine['memory_gib']:.0f} GiB), torch "
          f"{machine['torch']}, CUDA {machine['cuda']}: bf16 matmul {machine['bf16_matmul_tflops']:.0f} TFLOP/s, "
          f"copy {machine['copy_GBps']:.0f} GB/s", flush=True)
    torch.cuda.empty_cache()
    ckpt = build_checkpoint(args.cache)
    title = f"Qwen3-ASR-0.6B dims (random weights), bf16, {machine['name']}, torch {torch.__version__}"
    report: dict = dict(title=title, machine=machine, plan=asdict(plan), tokens_per_second=TOKENS_PER_SECOND)
    threads = torch.get_num_threads()
    try:
        report["qasr"] = in_subprocess(run_qasr_gpu, threads, ckpt, plan, "cuda", args.out / f"{stem}_qasr.json")
    except RuntimeError as exc:
        report["qasr"] = dict(error=str(exc))
        print(f"  qasr side failed: {exc}", flush=True)
    _write(args.out / f"{stem}.json", report)
    print(f"qasr side: {summary_line(report)}", flush=True)  # in the log even if the reference side is cut short
    if plan.reference_budget_s <= 0:
        report["reference"] = dict(batches={}, skipped="reference budget 0")
    else:
        try:  # the same checkpoint on disk, written once above
            report["reference"] = in_subprocess(run_reference_gpu, threads, ckpt, plan, "cuda",
                                                args.out / f"{stem}_reference.json")
        except RuntimeError as exc:
            report["reference"] = dict(error=str(exc))
            print(f"  transformers side failed: {exc}", flush=True)
    report["speedup"] = speedup(report)
    report["total_wall_s"] = time.perf_counter() - t0
    _write(args.out / f"{stem}.json", report)
    if report["qasr"].get("levels"):
        plot(report, args.out / f"{stem}.png")
    print()
    print(table(report))
    inv = report["qasr"].get("invariance")
    if inv:
        print(f"\nbf16 batch invariance: {inv['identical']}/{inv['compared']} requests identical in a batch and alone")
    print(f"wrote {args.out / (stem + '.json')}")
    print(summary_line(report))
    return 0 if all("error" not in report[side] for side in ("qasr", "reference")) else 1
