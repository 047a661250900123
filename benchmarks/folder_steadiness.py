"""Folder jobs, side by side: when does each input's output appear?

A folder of ~40 espeak-ng files of varied length (3-35 s: sentences of the demo model's vocabulary in
several voices and speeds, with 0.3-2 s pauses) is transcribed by ``qasr transcribe FOLDER -o OUT`` on
the bundled demo model, once per side per round, the sides alternating (the machine's speed moves, so
only side-by-side figures are compared). The benchmark watches OUT and records when each input's output
file appears, from the moment the command is started (the model's load is the same on both sides):

* wall: the whole command; work: wall less the start, which is measured as the same command's wall time
  on a folder of one 1 s clip (loading the model and kernels, then exiting), run just before;
* first: seconds of work until the first input is finished;
* files finished at 25 / 50 / 75 % of the work (what an interrupt at that moment keeps);
* order: Spearman's rank correlation between input order and completion order (1 = in input order).

A side is a source tree (``--before`` / ``--after``, each put on PYTHONPATH), so the code of another
branch or worktree runs without installing it:

    .venv/bin/python benchmarks/folder_steadiness.py --before /path/to/main/src --after src --rounds 3

Prints a table and writes JSON to --out (default benchmarks/results/folder_steadiness.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parent.parent
SR = 16000
SENTENCES = (
    "set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
    "turn off the lights in the bedroom", "remind me to buy milk tomorrow morning",
    "what is the weather like in paris on friday", "book a table for three people at eight thirty",
    "it costs twelve dollars and fifty cents", "how much is twelve plus nine",
    "the meeting is on the fourth of march at three", "set an alarm for seven thirty tomorrow",
    "play some jazz music", "navigate to the airport", "send a message to john saying see you soon",
)
VOICES = ("en-us", "en-gb", "en-us+f3", "en-gb-scotland+m3", "en-us+m3", "en-gb+f2")


def make_folder(folder: Path, files: int = 40, seed: int = 0) -> list[float]:
    """``files`` WAVs named in0000.wav ... (the job's input order), 3-35 s each; returns their durations."""
    from qasr.testing.speech import speak

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cache: dict[tuple[int, int, int], np.ndarray] = {}

    def said(k: int, v: int, speed: int) -> np.ndarray:
        if (k, v, speed) not in cache:
            with tempfile.TemporaryDirectory() as tmp:
                wave, sr = sf.read(speak(SENTENCES[k], Path(tmp) / "s.wav", voice=VOICES[v], speed=speed),
                                   dtype="float32")
            if sr != SR:
                import soxr

                wave = soxr.resample(wave, sr, SR).astype(np.float32)
            cache[(k, v, speed)] = wave
        return cache[(k, v, speed)]

    durations = []
    for i in range(files):
        target = float(rng.uniform(3, 35))
        v = int(rng.integers(len(VOICES)))
        parts = [np.zeros(int(0.3 * SR), np.float32)]
        n = 0
        while n < target * SR:
            wave = said(int(rng.integers(len(SENTENCES))), v, int(rng.choice((140, 160, 180))))
            pause = np.zeros(int(rng.uniform(0.3, 2.0) * SR), np.float32)
            parts += [wave, pause]
            n += len(wave) + len(pause)
        audio = np.concatenate(parts)
        sf.write(folder / f"in{i:04d}.wav", audio, SR)
        durations.append(len(audio) / SR)
    return durations


def run_job(src: str, folder: Path, out: Path, extra: list[str]) -> dict:
    """Run the folder job with ``src`` on PYTHONPATH; the time each output appears, from the start."""
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    cmd = [sys.executable, "-m", "qasr", "transcribe", str(folder), "-o", str(out), "-f", "json",
           "-m", str(ROOT / "models" / "qasr-demo-en"), "--no-progress", *extra]
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        done = proc.poll() is not None
        now = time.perf_counter() - t0
        if out.is_dir():
            for p in out.glob("*.json"):
                seen.setdefault(p.stem, now)
        if done:
            break
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed ({proc.returncode}):\n{err}")
    return {"wall_s": wall, "finished_at_s": dict(sorted(seen.items()))}


def summary(run: dict, names: list[str], load_s: float) -> dict:
    """The run's figures; the quarters are of its work: its wall time less the start (``load_s``: the same
    command on one short clip, which is loading the model and the kernels, then exiting)."""
    times = [run["finished_at_s"][n] for n in names]
    wall = run["wall_s"]
    work = wall - load_s
    at = {f"files_at_{p}pct": sum(t <= load_s + work * p / 100 for t in times) for p in (25, 50, 75)}
    ranks = np.argsort(np.argsort(times))
    spearman = float(np.corrcoef(np.arange(len(names)), ranks)[0, 1])
    return {"wall_s": round(wall, 2), "work_s": round(work, 2), "first_s": round(min(times) - load_s, 2), **at,
            "order": round(spearman, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree of the reference side (put on PYTHONPATH)")
    ap.add_argument("--after", default=str(ROOT / "src"), help="source tree of the side measured")
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--job-args", default="", help="more arguments for qasr transcribe, e.g. '--dtype float32'")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "folder_steadiness.json")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="qasr-steady-"))
    durations = make_folder(work / "in", args.files)
    names = [f"in{i:04d}" for i in range(args.files)]
    print(f"{args.files} inputs, {sum(durations):.0f} s of audio ({min(durations):.1f}-{max(durations):.1f} s each)")
    extra = args.job_args.split()
    (work / "one").mkdir()
    sf.write(work / "one" / "clip.wav", (0.01 * np.sin(np.arange(SR) / 7)).astype(np.float32), SR)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            load = run_job(getattr(args, side), work / "one", work / f"one-{side}-{r}", extra)["wall_s"]
            out = work / f"out-{side}-{r}"
            run = run_job(getattr(args, side), work / "in", out, extra)
            run["load_s"] = load
            run["summary"] = summary(run, names, load)
            runs[side].append(run)
            print(f"round {r} {side:6s} start {load:.2f} s {run['summary']}", flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(run["summary"][key] for run in runs[side])

    keys = ("wall_s", "work_s", "first_s", "files_at_25pct", "files_at_50pct", "files_at_75pct", "order")
    print(f"\n| median of {args.rounds} rounds | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for side in ("before", "after"):
        print(f"| {side} | " + " | ".join(f"{median(side, k):g}" for k in keys) + " |")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    result = {"cpu": cpu, "amx": amx, "threads": os.cpu_count(), "files": args.files,
              "audio_s": round(sum(durations), 1), "durations_s": [round(d, 2) for d in durations],
              "job_args": extra, "before": args.before, "after": args.after,
              "median": {side: {k: median(side, k) for k in keys} for side in runs}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"cpu: {cpu} (AMX: {'yes' if amx else 'no'}); wrote {args.out}")


if __name__ == "__main__":
    main()
