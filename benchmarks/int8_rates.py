"""int8 W8A8 GEMM rates on this CPU, side by side in one run: the torch reference of the spec (per-row
quantization, torch._int_mm, float32 epilogue: the whole path), qasr's AMX-INT8, AVX512-VNNI and 256-bit AVX-VNNI
kernels (quantization, product and epilogue fused), quantize="int4"'s W4A8 AVX512-VNNI kernel (the same weights in
int4 groups of 128), and for comparison qasr's batch-invariant bf16 kernel (native.linear_kernel(): AMX-BF16 or
AVX512-BF16) on the same shapes.

    PYTHONPATH=src .venv/bin/python benchmarks/int8_rates.py [--threads 2] [--repeats 5] [--min-seconds 1]
                                                             [--rounds 1] [--out benchmarks/results]

Prints a table of GOP/s (2 M N K / s; bf16 input, no bias, each path its fastest call after one untimed call, of at
least --repeats calls and --min-seconds) and, for one-row products, GB/s of weight bytes read (int8: N K; int4: the
packed N K / 2 plus a float32 scale per 128; bf16: 2 N K). Writes int8_rates.json to --out with the CPU, thread
count, which kernels ran and every rate (with --rounds N, the shapes are measured N times in turn and each path's
best round is reported, every round kept in the JSON). Only kernels that built and passed their self-test here are
measured. A small weight (1 x 1024 x 3072: 3 MB int8) stays in the caches between calls, so its GB/s is a cache
rate; the lm_head row (155 MB int8, 311 MB bf16) is a memory rate only where the last-level cache is smaller than
that (lscpu).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qasr.bench.perf.machine import ForeignCpu, cpu_info
from qasr.engine.cpu import native
from qasr.engine.cpu.int4 import quantize_weight_groups
from qasr.engine.cpu.int8 import int8_linear_reference

# (M, K, N): a decode row of a decoder projection and of the lm_head (vocabulary 151936), decode batches,
# a prefill chunk, the square peak shape the bf16 rates use, and one second of audio through the encoder's
# second 3x3 convolution as a GEMM (32 x 25 positions, 3 x 3 x 480 features, 480 channels)
SHAPES = ((1, 1024, 3072), (1, 1024, 151936), (16, 1024, 3072), (64, 1024, 3072), (256, 1024, 2048),
          (1024, 1024, 3072), (800, 4320, 480))
PATHS = ("torch_ref", "amx_int8", "vnni_int8", "avx_vnni_int8", "vnni_int4", "bf16")


def best_seconds(fn: Callable[[], object], repeats: int, min_seconds: float) -> float:
    """The fastest call of ``fn`` after one untimed one, over at least ``repeats`` calls and ``min_seconds``
    (at most 2000 calls): on a machine shared with other jobs, a 20 us call is often delayed by a whole
    scheduler slice when another process holds the second core, and a long run finds the quiet moments."""
    fn()
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < repeats or (time.perf_counter() - start < min_seconds and calls < 2000):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def kernels() -> dict[str, object]:
    found = {"amx_int8": native.amx_int8_kernel(), "vnni_int8": native.vnni_int8_kernel(),
             "avx_vnni_int8": native.avx_vnni_int8_kernel(), "vnni_int4": native.int4_kernel(),
             "bf16": native.linear_kernel()}
    return {name: mod for name, mod in found.items() if mod is not None}


def rates(m: int, k: int, n: int, mods: dict[str, object], repeats: int,
          min_seconds: float) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(n, generator=gen) * 0.01
    ops = 2.0 * m * n * k
    seconds = {"torch_ref": best_seconds(lambda: int8_linear_reference(x, w_q, w_scale), repeats, min_seconds)}
    for name in ("amx_int8", "vnni_int8", "avx_vnni_int8"):
        if name in mods:
            packed = mods[name].pack(w_q)
            seconds[name] = best_seconds(lambda: mods[name].linear(x, packed, n, w_scale, None), repeats,  # noqa: B023
                                         min_seconds)
            del packed
    weight_bytes = {p: n * k for p in seconds} | {"bf16": 2 * n * k}
    if "vnni_int4" in mods:  # quantize=int4's decoder product: the same weights in int4 groups of 128
        packed = mods["vnni_int4"].pack(*quantize_weight_groups(w_q.float() * w_scale[:, None]))
        seconds["vnni_int4"] = best_seconds(lambda: mods["vnni_int4"].linear(x, packed, n, None), repeats,
                                            min_seconds)
        weight_bytes["vnni_int4"] = packed.numel()  # int4 values and their float32 scales
        del packed
    if "bf16" in mods:
        w = (w_q.float() * w_scale[:, None]).to(torch.bfloat16)
        packed = mods["bf16"].pack(w)
        seconds["bf16"] = best_seconds(lambda: mods["bf16"].linear(x, packed, n, None), repeats, min_seconds)
        del w, packed
    out = {"gops": {p: ops / s / 1e9 for p, s in seconds.items()}}
    if m == 1:
        out["weight_gbs"] = {p: weight_bytes[p] / s / 1e9 for p, s in seconds.items()}
    return out


def _line(r: dict, cols: list[str]) -> str:
    m, k, n = r["shape"]
    line = f"{m:>5} x {k} x {n:<7}  " + "  ".join(f"{r['gops'][c]:10.1f}" for c in cols)
    if m == 1:
        line += "   (" + "  ".join(f"{c} {r['weight_gbs'][c]:.1f}" for c in cols) + " GB/s)"
    return line


def _best(rows: list[dict]) -> dict:
    """Each path's best rate over the rounds of one shape (other jobs on a shared machine only slow a path
    down, so the best round is the nearest to the idle machine's figure)."""
    out = {"shape": rows[0]["shape"], "gops": {p: max(r["gops"][p] for r in rows) for p in rows[0]["gops"]},
           "foreign_cpu_share": [r["foreign_cpu_share"] for r in rows]}
    if "weight_gbs" in rows[0]:
        out["weight_gbs"] = {p: max(r["weight_gbs"][p] for r in rows) for p in rows[0]["weight_gbs"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=1.0, help="time each path at least this long")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every shape this many times, interleaved; report each path's best round")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        mods = kernels()
        info = cpu_info()
        print(f"{info['model']}, {args.threads} threads; kernels: "
              + ", ".join(f"{name} ({getattr(mod, 'KIND', '?')})" for name, mod in mods.items()))
        cols = [p for p in PATHS if p == "torch_ref" or p in mods]
        rounds: list[list[dict]] = []
        for rnd in range(args.rounds):
            print(f"round {rnd + 1} of {args.rounds}")
            print(f"{'M x K x N':>20}  " + "  ".join(f"{c:>10}" for c in cols) + "   GOP/s (M = 1: weight GB/s)")
            table = []
            for m, k, n in SHAPES:
                with ForeignCpu() as foreign:
                    r = rates(m, k, n, mods, args.repeats, args.min_seconds)
                r.update(shape=[m, k, n], foreign_cpu_share=round(foreign.share, 3))
                table.append(r)
                print(_line(r, cols) + (f"   [other processes used {foreign.share:.0%} of the CPUs]"
                                        if foreign.share > 0.1 else ""), flush=True)
            rounds.append(table)
        best = [_best([t[i] for t in rounds]) for i in range(len(SHAPES))]
        if args.rounds > 1:
            print(f"best of {args.rounds} rounds")
            for r in best:
                print(_line(r, cols))
    isa = sorted(f for f in native.cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni")))
    result = {"cpu": {**info, "flags": isa},
              "torch": torch.__version__, "python": platform.python_version(), "threads": args.threads,
              "repeats": args.repeats, "min_seconds": args.min_seconds, "load_average": os.getloadavg(),
              "kernels": {name: getattr(mod, "KIND", "?") for name, mod in mods.items()}, "rounds": args.rounds,
              "rates": best, "rates_by_round": rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_rates.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'int8_rates.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
