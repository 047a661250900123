"""The host's share of a CUDA decode step: the time to plan one step's attention metadata and hand it to the
staging buffer, for a graph replay (``_Step.load``: the static buffers' rows, key lengths and block tables) and
for an eager step (``upload_meta``), at several batch sizes, with 256-token blocks scattered over the pool as a
busy engine leaves them and contexts of 300-1500 tokens. Runs on CPU tensors: the copies are host memcpys, so
what is timed is the planning a GPU step waits for before its replay.

    .venv/bin/python benchmarks/cuda_plan_host.py [--rows 16,64,256] [--repeats 300] [--out benchmarks/results]

Prints microseconds per step (median of 5 rounds) and writes cuda_plan_host.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from qasr.bench.perf.machine import cpu_info
from qasr.engine.cuda.graphs import _Step
from qasr.engine.cuda.kv_cache import TokenKVPool
from qasr.engine.cuda.plan import PinnedStaging, num_splits, pad_decode, upload_meta
from qasr.model.config import DecoderConfig

BLOCK, BLOCKS, CONTEXT = 256, 1600, 2048  # flash's block, a 400k-token pool, the first context bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = DecoderConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=65536, tie_word_embeddings=False)
    pool = TokenKVPool(cfg, BLOCKS, BLOCK, torch.device("cpu"), torch.bfloat16)
    staging = PinnedStaging(torch.device("cpu"))
    rng = np.random.default_rng(0)
    order = rng.permutation(BLOCKS).tolist()
    results = []
    for b in [int(x) for x in args.rows.split(",")]:
        ctxs = rng.integers(300, 1500, b).tolist()
        tables, at = [], 0
        for c in ctxs:
            n = -(-(c + 1) // BLOCK)
            tables.append(order[at:at + n])
            at += n
        step = _Step(None, pool, None, b, CONTEXT, num_splits(b, 8, CONTEXT, 264), staging)  # no forward: no model

        def graph_load(b: int = b, ctxs: list[int] = ctxs, tables: list[list[int]] = tables,
                       step: _Step = step) -> None:
            step.load(pad_decode([1] * b, ctxs, tables, ctxs, b, pool.scratch_block))

        def eager(b: int = b, ctxs: list[int] = ctxs, tables: list[list[int]] = tables) -> None:
            upload_meta(staging, tables, BLOCK, [1] * b, ctxs, b, [1] * b, ctxs, list(range(b)), [])

        row = dict(rows=b)
        for name, fn in (("graph_load_us", graph_load), ("eager_meta_us", eager)):
            rounds = []
            for _ in range(5):
                fn()
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    fn()
                rounds.append((time.perf_counter() - t0) / args.repeats * 1e6)
            row[name] = round(statistics.median(rounds), 1)
        results.append(row)
        print(f"rows={b:4d}  graph load {row['graph_load_us']:7.1f} us  eager metadata {row['eager_meta_us']:7.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_plan_host.json").write_text(json.dumps(dict(cpu=cpu_info(), results=results), indent=2))


if __name__ == "__main__":
    main()
