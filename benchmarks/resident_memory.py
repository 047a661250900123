"""Resident memory of a loaded model by quantize mode: what a user must plan for.

Each mode (bf16 ``none``, ``int8``, ``int4``) runs in a fresh process: import qasr, then
``ASR.from_pretrained(model, device="cpu", dtype="bfloat16", quantize=mode)`` with a small fixed KV cache (so the
figure is the weights and the runtime), then one short transcription (examples/alarm.flac). It reports the
process's resident memory (VmRSS, split into anonymous and file-backed pages) after the imports, after loading
and after the transcription, and its peak (VmHWM). ``--before SRC`` runs the same modes on another checkout's
``src`` too (e.g. a ``git worktree`` of an earlier commit; ``--after``: this checkout's by default), each in its
own process, interleaved in one run.

    .venv/bin/python benchmarks/resident_memory.py [--modes none int8 int4] [--kv-mib 64] [--model DIR]
                                                   [--before /tmp/h4-before/src] [--out benchmarks/results]

The model is a random checkpoint with the real Qwen3-ASR-0.6B dimensions (bf16, untied LM head), built once in
--cache. Prints a table, writes resident_memory.json and .png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIP = ROOT / "examples" / "alarm.flac"
MODES = ("none", "int8", "int4")
TARGETS_GIB = {"none": 2.3, "int8": 1.7, "int4": 1.4}  # the plan: packed weights, the runtime, little else
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def memory() -> dict[str, float]:
    """This process's VmRSS, RssAnon, RssFile and VmHWM in GiB (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024 / 2**30
    return out


def child(model: str, mode: str, kv_bytes: int, threads: int) -> dict:
    """One mode in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    import qasr
    from qasr import ASR, EngineConfig

    kernels: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kernels.append(record.getMessage().partition("CPU kernels: ")[2])  # type: ignore
    handler.addFilter(lambda record: "CPU kernels" in record.getMessage())
    logging.getLogger("qasr").addHandler(handler)
    logging.getLogger("qasr").setLevel(logging.INFO)
    imported = memory()
    t0 = time.perf_counter()
    asr = ASR.from_pretrained(model, device="cpu", dtype="bfloat16", quantize=None if mode == "none" else mode,
                              engine=EngineConfig(kv_cache_bytes=kv_bytes, threads=threads))
    load_s = time.perf_counter() - t0
    loaded = memory()
    t0 = time.perf_counter()
    result = asr.transcribe(str(CLIP), max_new_tokens=32)[0]
    transcribe_s = time.perf_counter() - t0
    after = memory()
    out = dict(mode=mode, qasr=str(Path(qasr.__file__).resolve().parent), kernels=kernels[0] if kernels else "",
               load_s=load_s, transcribe_s=transcribe_s,
               text_chars=len(result.text), imported=imported, loaded=loaded, transcribed=after,
               peak_gib=after["VmHWM"])
    asr.close()
    return out


def run_child(model: str, mode: str, kv_bytes: int, threads: int, src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--child", "--model", model, "--modes", mode, "--kv-mib",
           str(kv_bytes / 2**20), "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} ({src}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def git_commit(src: Path) -> str:
    proc = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in ("before", "after") if s in report["runs"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / (2 * len(sides))
    for i, mode in enumerate(report["modes"]):
        for j, side in enumerate(sides):
            run = report["runs"][side][mode]
            x = i + (j * 2 - len(sides) + 0.5) * width
            ax.bar(x, run["transcribed"]["VmRSS"], width, color=("#bbbbbb", "#4c72b0")[j],
                   label=f"{side}: after a transcription" if i == 0 else None)
            ax.bar(x + width, run["peak_gib"], width, color=("#dddddd", "#9fb7d9")[j],
                   label=f"{side}: peak" if i == 0 else None)
        target = TARGETS_GIB.get(mode)
        if target is not None:
            ax.hlines(target, i - 0.45, i + 0.45, colors="#c44e52", linestyles="dashed",
                      label="target" if i == 0 else None)
    ax.set_xticks(range(len(report["modes"])), [("bf16" if m == "none" else m) for m in report["modes"]])
    ax.set_ylabel("resident memory, GiB")
    ax.set_title(f"0.6B dims, {report['kv_cache_mib']:g} MiB KV cache, {report['cpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random 0.6B-dims one)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--kv-mib", type=float, default=64.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--before", default=None, help="another checkout's src folder, measured beside --after")
    p.add_argument("--after", default=str(ROOT / "src"), help="the src folder measured (default: this checkout's)")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    kv_bytes = int(args.kv_mib * 2**20)
    if args.child:
        print(json.dumps(child(args.model, args.modes[0], kv_bytes, args.threads)))
        return

    from qasr.bench.common import build_checkpoint
    from qasr.bench.perf.machine import cpu_info

    args.cache.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_checkpoint(args.cache))
    sides = {"after": args.after} if args.before is None else {"before": args.before, "after": args.after}
    report: dict = dict(cpu=cpu_info()["model"], model=model, modes=args.modes, kv_cache_mib=args.kv_mib,
                        threads=args.threads, targets_gib=TARGETS_GIB, clip=CLIP.name, runs={s: {} for s in sides},
                        commits={s: git_commit(Path(src).parent) for s, src in sides.items()})
    for mode in args.modes:
        for side, src in sides.items():
            print(f"{mode} ({side}) ...", flush=True)
            report["runs"][side][mode] = run_child(model, mode, kv_bytes, args.threads, src)
    print(f"\n{'mode':6} {'side':7} {'imported':>9} {'loaded':>7} {'anon':>6} {'file':>6} {'after':>7} {'peak':>7}"
          f" {'target':>7}  GiB")
    for mode in args.modes:
        for side in sides:
            r = report["runs"][side][mode]
            print(f"{mode:6} {side:7} {r['imported']['VmRSS']:9.2f} {r['loaded']['VmRSS']:7.2f} "
                  f"{r['loaded']['RssAnon']:6.2f} {r['loaded']['RssFile']:6.2f} {r['transcribed']['VmRSS']:7.2f} "
                  f"{r['peak_gib']:7.2f} {TARGETS_GIB[mode]:7.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resident_memory.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "resident_memory.png")
    print(f"\nwrote {args.out}/resident_memory.json and .png ({report['cpu']})")


if __name__ == "__main__":
    main()
