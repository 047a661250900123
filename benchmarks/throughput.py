"""Throughput benchmark, qasr against transformers side by side: see qasr.bench (also `qasr bench`).

Last line: `speedup=<x> rtfx=<y> efficiency=<z>` (efficiency: qasr's model FLOP/s over this machine's
measured bf16 GEMM peak)."""

from qasr.bench.main import main

if __name__ == "__main__":
    raise SystemExit(main())
