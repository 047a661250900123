"""bf16 GEMM rates on this CPU: torch's F.linear (oneDNN; on AMX tiles where the CPU has them) against
qasr's batch-invariant kernels (AMX-BF16 and AVX512-BF16, each only if it built and passed its self-test).

Why: the AMX kernel has only run on a scalar model of the tile instructions on our AMD machines. A lent
device machine's host CPU may have AMX (scripts/gpu_check.sh --amx runs this there); its figures then say
whether the kernel reaches oneDNN's speed at the shapes the engine runs, at the thread count we use.

    .venv/bin/python scripts/amx_rates.py [--threads 2] [--out rates.json]

Prints one line per shape and writes JSON with the CPU's flags and every rate (GFLOP/s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qasr.bench.perf.machine import cpu_info, gemm_rates
from qasr.engine.cpu import native

# (M, K, N): the benchmark's peak shape, then decoder-like shapes at decode and prefill row counts
SHAPES = ((1024, 1024, 3072), (16, 1024, 3072), (64, 1024, 3072), (256, 1024, 2048), (1, 1024, 151936))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = {name: mod for name, mod in (("amx", native.amx_kernel()), ("avx512", native.avx512_kernel()))
               if mod is not None}
    info = cpu_info()
    print(f"{info['model']}, {args.threads} threads; qasr kernels that passed their self-test: "
          f"{', '.join(kernels) or 'none'}")
    table = []
    for m, k, n in SHAPES:
        r = {name: v / 1e9 for name, v in gemm_rates(m, k, n, kernels, args.repeats).items()}
        table.append({"shape": [m, k, n], "gflops": r})
        print(f"  {m:>5} x {k} x {n:<6} " + "  ".join(f"{name} {v:7.1f}" for name, v in r.items()) + "  GFLOP/s",
              flush=True)
    result = {"cpu": info, "threads": args.threads, "kernels": sorted(kernels), "rates": table}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
