"""Throughput benchmark, qasr against transformers side by side: see qasr.bench (also `qasr bench`).

Last line: `speedup=<x> rtfx=<y> efficiency=<z>` (efficiency: qasr's model FLOP/s over this machine's
measured bf16 GEMM peak). With `--quantize int8` (or `int4`): the reference, qasr bf16 and qasr int8 (int4) in
one run; the last line gives the mode's figures and `int8_over_bf16=<x>` (`int4_over_bf16=<x>`; a line before it,
bf16's)."""

from qasr.bench.main import main

if __name__ == "__main__":
    raise SystemExit(main())
