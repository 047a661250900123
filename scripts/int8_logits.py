"""How far int8 (or int4, ``--quantize int4``; or the int8 KV cache, ``--kv-cache-dtype int8``) moves the
model's outputs: teacher-forced logits of quantize="int8" against the same checkpoint without it, position by
position.

For each clip the unquantized engine decodes greedily (the token sequence both sides are then fed); one
forward of the whole prompt plus those tokens runs with each side's prepared kernels (the engine's own
products: qasr's bf16 or float32 GEMMs, and the int8 ones), and at every generated position the two
logit rows are compared: cosine similarity, whether the top-1 token agrees, and the log-probability
the int8 side gives the token the unquantized side chose. The int8 engine's own greedy output is also
compared with the unquantized one (clips whose tokens are identical; first position of divergence).

Two checkpoints, as the quantization docs report them:

- ``--model 0.6b``: the throughput benchmark's random checkpoint with the real 0.6B dimensions (bf16) on the
  quick benchmark's 16 noise clips of 2-120 s, each forced to 4 tokens per audio second (its logits are
  nearly flat: a hard case for top-1 agreement, since small moves flip near-ties);
- ``--model PATH`` (e.g. models/qasr-demo-en) on ``--clips N`` speech clips of a validation manifest
  (``--data``, scripts/make_demo_data.py), decoded until end of text.

    .venv/bin/python scripts/int8_logits.py --model 0.6b
    .venv/bin/python scripts/int8_logits.py --model models/qasr-demo-en --data data/demo --clips 60
    .venv/bin/python scripts/int8_logits.py --model 0.6b --quantize int4
    .venv/bin/python scripts/int8_logits.py --model 0.6b --quantize none --kv-cache-dtype int8
    .venv/bin/python scripts/int8_logits.py --model 0.6b --quantize int8 --kv-cache-dtype int8

With ``--kv-cache-dtype int8`` the quantized side's keys and values are stored as int8 (engine/kv_cache.py):
its teacher-forced forward prefills through an int8 pool, so every position attends over dequantized keys and
values, as the engine's prefill chunks do (its decode kernel reads the same int8 values in float32); its greedy
tokens come from an engine with that KV cache. ``--quantize none`` keeps the weights as they are, so the
figures are the KV cache's alone.

Writes JSON (``--out``); prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from qasr.audio.features import LogMel
from qasr.bench.common import TOKENS_PER_SECOND, build_checkpoint, clip_lengths, make_clip
from qasr.engine.config import KV_CACHE_DTYPES
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import single_prefill
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.config import audio_token_count
from qasr.model.kernels import Kernels
from qasr.model.prompt import build_prompt
from qasr.transcribe.pieces import default_token_cap

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def greedy(ck: Checkpoint, clips: list[np.ndarray], forced: list[int] | None, quantize: str | None,
           kv_dtype: str = "auto") -> list[list[int]]:
    """Every clip's greedy tokens from one engine (all submitted at once, as a user's batch)."""
    with Engine(ck, EngineConfig(quantize=quantize, kv_cache_dtype=kv_dtype)) as engine:
        futures = []
        for k, wave in enumerate(clips):
            prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160))
            if forced:
                futures.append(engine.submit(RequestSpec(prompt, forced[k], waveform=wave, ignore_eos=True)))
            else:  # until end of text, within the cap transcribe() gives a clip of this length
                cap = default_token_cap(len(wave) / 16000, 15.0)
                futures.append(engine.submit(RequestSpec(prompt, cap, waveform=wave)))
        return [list(f.result().token_ids) for f in futures]


def logits(ck: Checkpoint, kernels: Kernels, wave: np.ndarray, tokens: list[int], kv_dtype: str = "auto"
           ) -> torch.Tensor:
    """The logit rows that predicted ``tokens`` (float32), from one teacher-forced forward with ``kernels``
    through a KV pool of ``kv_dtype``."""
    model = ck.model
    prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160))
    with torch.inference_mode():
        audio = model.audio_tower([LogMel(ck.features)(wave)], kernels=kernels)[0]
        ids = prompt + tokens[:-1]
        cache, meta = single_prefill(ck.config.decoder, len(ids), ck.device, ck.dtype, kv_dtype=kv_dtype)
        rows = torch.arange(len(prompt) - 1, len(ids))
        return model(torch.tensor(ids), torch.arange(len(ids)), cache, meta, logits_rows=rows, audio_embeds=audio,
                     kernels=kernels).float()


def compare(ck: Checkpoint, clips: list[np.ndarray], forced: list[int] | None, mode: str | None = "int8",
            kv_dtype: str = "auto") -> dict:
    """``mode``: the quantized side's weights (int8, int4, or None: as the base side's); ``kv_dtype``: its KV
    cache."""
    t0 = time.perf_counter()
    base = prepare_cpu(ck.model, use_native=True)
    int8 = prepare_cpu(ck.model, use_native=True, quantize=mode)  # the quantized side (int8, int4 or as is)
    print(f"kernels: {base.description}\n   {mode or 'none'} (kv {kv_dtype}): {int8.description}", flush=True)
    tokens = greedy(ck, clips, forced, None)
    tokens_int8 = greedy(ck, clips, forced, mode, kv_dtype)
    cos, top1, logprob_drop, per_clip = [], [], [], []
    for k, (wave, toks) in enumerate(zip(clips, tokens, strict=True)):
        if not toks:
            continue
        a, b = logits(ck, base.kernels, wave, toks), logits(ck, int8.kernels, wave, toks, kv_dtype)
        c = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        agree = (a.argmax(-1) == b.argmax(-1)).float()
        chosen = torch.tensor(toks)
        rows = torch.arange(len(toks))
        drop = (torch.log_softmax(a, -1)[rows, chosen] - torch.log_softmax(b, -1)[rows, chosen])
        cos += c.tolist()
        top1 += agree.tolist()
        logprob_drop += drop.tolist()
        same = tokens_int8[k] == toks
        first = next((i for i, (x, y) in enumerate(zip(toks, tokens_int8[k], strict=False)) if x != y),
                     None if same else min(len(toks), len(tokens_int8[k])))
        per_clip.append(dict(seconds=round(len(wave) / 16000, 2), tokens=len(toks), cos_min=round(float(c.min()), 6),
                             top1=round(float(agree.mean()), 4), greedy_identical=same, first_divergence=first))
        print(f"  clip {k:>2} {len(wave) / 16000:6.1f} s {len(toks):>4} tokens: cos mean {float(c.mean()):.5f} "
              f"min {float(c.min()):.5f}, top-1 {100 * float(agree.mean()):.1f}%, greedy "
              f"{'identical' if same else f'diverges at {first}'}", flush=True)
    return dict(positions=len(cos), cos_mean=statistics.fmean(cos), cos_min=min(cos),
                cos_p01=float(np.percentile(cos, 1)), top1_agreement=statistics.fmean(top1),
                chosen_logprob_drop_mean=statistics.fmean(logprob_drop),
                greedy_identical_clips=sum(c["greedy_identical"] for c in per_clip), clips=len(per_clip),
                per_clip=per_clip, wall_s=round(time.perf_counter() - t0, 1),
                kernels=base.description, **{f"kernels_{mode or 'none'}": int8.description})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.6b", help="0.6b (the benchmark's random checkpoint) or a model folder")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "demo", help="a manifest folder (with --model PATH)")
    ap.add_argument("--clips", type=int, default=60, help="speech clips of the manifest (with --model PATH)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "qasr-bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quantize", default="int8", choices=("none", "int8", "int4"),
                    help="the quantized side's weights (none: as the checkpoint's, to measure the KV cache alone)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="the quantized side's KV cache")
    args = ap.parse_args()
    if args.model == "0.6b":
        ck = load_checkpoint(build_checkpoint(args.cache), device="cpu", dtype="bfloat16")
        lengths = clip_lengths(16, 0)
        clips = [make_clip(s, k) for k, s in enumerate(lengths)]  # the quick throughput benchmark's clips
        forced = [max(1, round(TOKENS_PER_SECOND * s)) for s in lengths]
        name = "0.6b-dims-random"
    else:
        ck = load_checkpoint(args.model, device="cpu", dtype=args.dtype)
        rows = [json.loads(line) for line in (args.data / "val.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["text"]][: args.clips]
        clips = [sf.read(str(args.data / r["path"]), dtype="float32")[0] for r in rows]
        forced = None
        name = Path(args.model).name
    print(f"{name}, {ck.dtype}, {len(clips)} clips; {cpu_model()}, {torch.get_num_threads()} threads", flush=True)
    mode = None if args.quantize == "none" else args.quantize
    if mode is None and args.kv_cache_dtype == "auto":
        ap.error("nothing to compare: give --quantize int8/int4 or --kv-cache-dtype int8")
    result = compare(ck, clips, forced, mode, args.kv_cache_dtype)
    report = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), date=date.today().isoformat(),
                  cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__, model=name,
                  dtype=str(ck.dtype).removeprefix("torch."), quantize=args.quantize,
                  kv_cache_dtype=args.kv_cache_dtype, **result)
    print("| model | positions | cosine mean | cosine p1 | cosine min | top-1 agreement | chosen logprob drop | "
          "greedy identical |\n|---|---|---|---|---|---|---|---|")
    print(f"| {name} ({report['dtype']}) | {result['positions']} | "
          f"{result['cos_mean']:.5f} | {result['cos_p01']:.5f} | {result['cos_min']:.5f} | "
          f"{100 * result['top1_agreement']:.2f}% | {result['chosen_logprob_drop_mean']:.4f} | "
          f"{result['greedy_identical_clips']} of {result['clips']} clips |")
    stem = args.quantize if args.kv_cache_dtype == "auto" else (
        f"kv{args.kv_cache_dtype}" if mode is None else f"{args.quantize}_kv{args.kv_cache_dtype}")
    out = args.out or ROOT / "docs" / "bench" / f"{stem}_logits_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
