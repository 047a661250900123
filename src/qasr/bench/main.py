"""Side-by-side throughput benchmark: qasr's engine against transformers' qwen3_asr generate.

``qasr bench`` parses the flags and runs one mode, loaded only when chosen: cpu.py (the default), gpu.py
(``--device cuda``) or aligner.py (``--aligner``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from qasr.engine.config import KV_CACHE_DTYPES, QUANTIZE_CHOICES, QUANTIZE_MODES


def main(argv: list[str] | None = None) -> int:
    """``qasr bench``: parse the flags, set the threads, run the chosen mode."""
    p = argparse.ArgumentParser(prog="qasr bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workload, finishes in under 5 minutes on 2 cores")
    p.add_argument("--clips", type=int, default=None,
                   help="number of 2-120 s clips (2-60 s with --aligner; default 16 quick, 48 full)")
    p.add_argument("--aligner", action="store_true",
                   help="forced alignment instead: qasr.Aligner against transformers' token classification "
                        "(qasr.bench.aligner; ends with aligner_speedup=<x> aligner_rtfx=<y>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gib", type=float, default=6.0, help="qasr KV-cache budget")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "qasr-bench")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help=f"{' or '.join(QUANTIZE_MODES)}: run qasr twice, bf16 and quantize=<mode> "
                        "(docs/quantization.md), against the same reference; the last line's speedup, rtfx and "
                        "efficiency are then the mode's, followed by <mode>_over_bf16=<x> (its RTFx over bf16's, "
                        "e.g. int8_over_bf16=<x>); output files end in _<mode>. CPU mode only")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="int8: the quantized side's KV cache in int8 (without --quantize: qasr's side), bf16 keeps "
                        "its own; output files end in _kvint8. CPU mode only")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --quantize: run the two qasr sides this many times in turn (rounds after the first "
                        "without TTFT) and report the median <mode>_over_bf16; the machine's drift between one "
                        "side's run and the other's moves a single pair's ratio (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU mode (qasr.bench.gpu): closed-loop concurrency 1/16/128/512 on ~2-minute "
                        "clips, TTFT, GPU memory, bf16 batch invariance, transformers generate at batch 8 and 32; "
                        "ends with gpu_rtfx_c128=<x> ttft_p50_c1_ms=<y> speedup_vs_transformers=<z>")
    p.add_argument("--gpu-budgets", default=None,
                   help="cuda: seconds per concurrency level (1, 16, 128, 512), comma-separated; 0 skips a "
                        "level (default 20,30,45,60; --quick 15,20,30,40)")
    p.add_argument("--gpu-reference-budget", type=float, default=None,
                   help="cuda: seconds for transformers' batches; a batch starts only if the last one's time "
                        "still fits; 0 runs no reference (default 50; --quick 30)")
    p.add_argument("--gpu-kv-gib", type=float, default=0.0, help="cuda: KV-cache budget (default: 60%% of free memory)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.rounds < 1 or (args.rounds > 1 and args.quantize == "none"):
        p.error("--rounds N (N >= 1) compares the two qasr sides: give --quantize too")
    if args.kv_cache_dtype != "auto" and (args.device == "cuda" or args.aligner):
        p.error(f"--kv-cache-dtype {args.kv_cache_dtype} is for the CPU throughput mode")
    if args.quantize != "none" and (args.device == "cuda" or args.aligner):
        p.error(f"--quantize {args.quantize} is for the CPU throughput mode (qasr's {args.quantize} path runs on "
                "the CPU only)")
    if args.device == "cuda":
        if args.aligner:
            p.error("--aligner has no GPU mode yet")
        from qasr.bench import gpu

        return gpu.run(args)
    if args.aligner:
        from qasr.bench import aligner

        return aligner.run(args)
    from qasr.bench import cpu

    return cpu.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
