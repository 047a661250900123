"""Decode attention over the int8 KV cache against the bf16 one, side by side in one run: one layer of the 0.6B
decoder (16 query heads, 8 kv heads, head_dim 128, bf16 queries), 64-token blocks scattered over the pool as a
busy engine leaves them, for several batch x context shapes. As in a decode step, where each of the 28 layers
reads its own cache, the calls cycle over as many layers' pools as make at least 256 MB of bf16 cache (up to
28), so that no shape is timed out of the last-level cache. Both paths are qasr's native decode kernel
(``decode_attention`` over a bf16 pool, ``decode_attention_int8`` over int8 values with a float32 scale per row);
the two are timed in turn, round after round, so the machine's drift falls on both.

    .venv/bin/python benchmarks/kv_int8_rates.py [--threads 2] [--rounds 5] [--blocks scattered|consecutive]
        [--out benchmarks/results]

Prints a table (ms per call, GB/s of KV bytes read: keys and values of every position, plus the scales for int8;
the int8 / bf16 time ratio) and writes kv_int8_rates.json and kv_int8_rates.png to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from qasr.bench.perf.machine import ForeignCpu, cpu_info
from qasr.engine.cpu.native import decode_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 64  # the 0.6B decoder's attention (spec §3) and the engine's blocks
SHAPES = ((1, 900), (4, 900), (16, 900), (64, 900), (4, 4096), (16, 4096))  # (sequences, keys each)


def pools(batch: int, context: int, gen: torch.Generator, scattered: bool = True) -> dict:
    """A bf16 pool and its int8 twin (the same values, quantized as the engine stores them), with block tables
    drawn at random over a pool twice as large as the sequences need (``scattered``), or each sequence's blocks
    one after the other, as a fresh engine hands them out."""
    per_seq = -(-context // BLOCK)
    num_blocks = 2 * batch * per_seq
    order = torch.randperm(num_blocks, generator=gen) if scattered else torch.arange(num_blocks)
    order = order[: batch * per_seq].view(batch, per_seq)
    shape = (KV_HEADS, num_blocks * BLOCK, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    kernel = decode_kernel()
    kq, ks = kernel.quantize_kv(k)
    vq, vs = kernel.quantize_kv(v)
    return dict(q=torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16), k=k, v=v, kq=kq, ks=ks,
                vq=vq, vs=vs, tables=order.to(torch.int64), lens=torch.full((batch,), context, dtype=torch.int64))


LAYER_BYTES = 256 << 20  # bf16 cache cycled over per shape: past any last-level cache here
MAX_LAYERS = 28


def timed(calls: list, min_seconds: float) -> float:  # noqa: ANN001 - calls, one per layer's pool
    """Median seconds of a call, over whole cycles of ``calls`` (at least 5 and ``min_seconds``), after one
    untimed cycle."""
    for fn in calls:
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        times.append((time.perf_counter() - t0) / len(calls))
    return statistics.median(times)


def measure(batch: int, context: int, rounds: int, min_seconds: float, scattered: bool = True) -> dict:
    kernel = decode_kernel()
    gen = torch.Generator().manual_seed(batch * 10_000 + context)
    first = pools(batch, context, gen, scattered)
    layers = min(MAX_LAYERS, max(1, -(-LAYER_BYTES // (first["k"].numel() * 2 * 2))))
    ps = [first] + [pools(batch, context, gen, scattered) for _ in range(layers - 1)]
    scale = HEAD_DIM ** -0.5
    bf16 = [lambda p=p: kernel.decode_attention(p["q"], p["k"], p["v"], p["tables"], p["lens"], BLOCK, scale)
            for p in ps]
    int8 = [lambda p=p: kernel.decode_attention_int8(p["q"], p["kq"], p["vq"], p["ks"], p["vs"], p["tables"],
                                                     p["lens"], BLOCK, scale) for p in ps]
    got, want = int8[0]().float(), bf16[0]().float()
    cos = float(torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1), dim=-1).min())
    runs: dict[str, list[float]] = {"bf16": [], "int8": []}
    with ForeignCpu() as foreign:
        for _ in range(rounds):
            runs["bf16"].append(timed(bf16, min_seconds))
            runs["int8"].append(timed(int8, min_seconds))
    rows = batch * context * KV_HEADS  # key rows read (and as many value rows)
    bytes_read = {"bf16": 2 * rows * HEAD_DIM * 2, "int8": 2 * rows * (HEAD_DIM + 4)}
    out = dict(batch=batch, context=context, layers=layers, foreign_cpu_share=round(foreign.share, 3), cosine_min=cos)
    for name, r in runs.items():
        s = statistics.median(r)
        out[name] = dict(ms=1e3 * s, gb_per_s=bytes_read[name] / s / 1e9, runs_ms=[1e3 * x for x in r])
    out["int8_over_bf16"] = out["int8"]["ms"] / out["bf16"]["ms"]
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['batch']} x {r['context']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r["bf16"]["ms"] for r in rows], 0.4, label="bf16 KV")
    ax.bar([i + 0.2 for i in x], [r["int8"]["ms"] for r in rows], 0.4, label="int8 KV")
    for i, r in zip(x, rows, strict=True):
        ax.text(i + 0.2, r["int8"]["ms"], f"{r['int8_over_bf16']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("sequences x keys each (one layer, 16 heads / 8 kv heads, head_dim 128)")
    ax.set_ylabel("ms per decode attention call")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="bf16 and int8 timed in turn this many times (median)")
    ap.add_argument("--min-seconds", type=float, default=0.3, help="time each path at least this long a round")
    ap.add_argument("--blocks", choices=("scattered", "consecutive"), default="scattered",
                    help="where a sequence's blocks lie: at random over the pool (a busy engine) or one after another")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if decode_kernel() is None or not hasattr(decode_kernel(), "decode_attention_int8"):
        raise SystemExit("qasr's decode attention kernel did not build here (qasr kernels build)")
    info = cpu_info()
    title = f"decode attention, int8 against bf16 KV ({args.blocks} blocks): {info['model']}, {args.threads} threads"
    print(title)
    print("| sequences x keys | bf16 ms | bf16 GB/s | int8 ms | int8 GB/s | int8 / bf16 | cosine min | others' CPU |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    with torch.inference_mode():
        for batch, context in SHAPES:
            r = measure(batch, context, args.rounds, args.min_seconds, args.blocks == "scattered")
            rows.append(r)
            print(f"| {batch} x {context} | {r['bf16']['ms']:.3f} | {r['bf16']['gb_per_s']:.1f} | "
                  f"{r['int8']['ms']:.3f} | {r['int8']['gb_per_s']:.1f} | {r['int8_over_bf16']:.2f} | "
                  f"{r['cosine_min']:.5f} | {100 * r['foreign_cpu_share']:.0f}% |", flush=True)
    report = dict(title=title, cpu=info, torch=torch.__version__, python=platform.python_version(),
                  threads=args.threads, rounds=args.rounds, blocks=args.blocks, heads=HEADS, kv_heads=KV_HEADS,
                  head_dim=HEAD_DIM, block_tokens=BLOCK, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_int8_rates.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, args.out / "kv_int8_rates.png", title)
    print(f"wrote {args.out / 'kv_int8_rates.json'} and {args.out / 'kv_int8_rates.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
