"""One live session's push latency with and without checking guessed tokens (``EngineConfig.drafts``), or with
``--compare end_on_chunk`` with and without ending a paused turn at its chunk boundary
(``LiveConfig.end_on_chunk``), side by side in one run.

A live step's prompt ends with the last output minus its last 5 tokens (the official rollback), and the
model mostly makes those tokens again. With drafts on, the step hands them to the engine as a guess
(``Continuation.draft``), which feeds each guess in a decode row of its own beside the newest token
and keeps the tokens of the rows whose guesses came true: several tokens for one pass over the weights.
The output is the same bit for bit; this run checks that every event of the two sides is identical.

Each round makes one LiveSession per side (default LiveConfig: VAD turns, 500 ms pause; 1 s chunks,
unfixed_chunk_num 2, unfixed_token_num 5, max_new_tokens 9), each on a fresh engine (one engine at a time:
two engines in one process share the cores badly), and pushes the same audio 1 s at a time as fast as the
pushes return; the sides alternate (off, on, off, on, ...), so the machine's drift falls on both. The first
5 pushes of each session are not counted.

How much the guesses save depends on how often they come true, which is the model's: the bundled demo
model (trained) made again 193 of 193 guessed tokens over a minute of live speech; the random checkpoints
at the real 0.6B dimensions are built in the streaming benchmark's cache (qasr.testing.speaking):
``steady`` (a fixed chain of words, like a trained model's transcript) and ``words`` (random picks that flip
with any change of the audio: about 1 guess in 5 comes true).

    .venv/bin/python benchmarks/live_drafts.py                          # 0.6B dims, steady, int4 and int8
    .venv/bin/python benchmarks/live_drafts.py --transcript words --quantize int4
    .venv/bin/python benchmarks/live_drafts.py --model models/qasr-demo-en --quantize none
    .venv/bin/python benchmarks/live_drafts.py --compare end_on_chunk --transcript words --quantize int8

``--compare end_on_chunk`` (drafts on for both sides): a turn that a pause ends takes the silent frames up to
its chunk boundary, so no push runs a chunk's step and the tail's back to back; the turns' audio differs (the
padding), so the events are not compared. Instead, per turn, the time from the pause (``SpeechStopped.at``) to
its final transcript in a stream paced in real time: the push that returned it ends at (index + 1) s of audio
and took its measured seconds, so the final is there ``index + 1 - at + seconds`` after the pause (valid while
the session keeps up with real time, which the push latencies show).

Prints a table, writes live_drafts[_<name>].json and .png to --out (default docs/bench/).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

WARMUP_PUSHES = 5
SETTINGS = dict(chunk_size_sec=1.0, unfixed_chunk_num=2, unfixed_token_num=5, max_new_tokens=9)


COMPARED = {"drafts": "guessed tokens checked (EngineConfig.drafts)",
            "end_on_chunk": "a paused turn ends at its chunk boundary (LiveConfig.end_on_chunk)"}


def session_run(ck, quantize: str | None, compare: str, on: bool, audio: np.ndarray, pushes: int) -> dict:  # noqa: ANN001
    """One LiveSession on a fresh engine: each push's seconds, the events' text, the engine's guess counts and,
    per turn, the time from its pause to its final transcript in a stream paced in real time."""
    from qasr.engine.engine import Engine, EngineConfig
    from qasr.streaming.config import LiveConfig, StreamConfig
    from qasr.streaming.live import LiveSession, SpeechStopped, TurnFinal, TurnUpdate

    sr = ck.features.sampling_rate
    drafts = on or compare != "drafts"
    end_on_chunk = on or compare != "end_on_chunk"
    with Engine(ck, EngineConfig(kv_cache_bytes=2**28, quantize=quantize, drafts=drafts)) as engine:
        live = LiveSession(engine, ck, LiveConfig(stream=StreamConfig(**SETTINGS), end_on_chunk=end_on_chunk))
        seconds, events, stopped, final_after_pause = [], [], {}, []
        for k in range(pushes):
            t0 = time.perf_counter()
            out = live.push(audio[k * sr:(k + 1) * sr])
            seconds.append(time.perf_counter() - t0)
            events += [repr(e) for e in out if isinstance(e, TurnUpdate | TurnFinal)]
            for e in out:
                if isinstance(e, SpeechStopped):
                    stopped[e.turn] = e.at
                elif isinstance(e, TurnFinal) and e.turn in stopped and k >= WARMUP_PUSHES:
                    final_after_pause.append(k + 1 - stopped[e.turn] + seconds[-1])
        live.close()
        return dict(seconds=seconds, events=events, final_after_pause=final_after_pause,
                    verifies=engine.verifies_drafts, guessed=int(engine.timings["draft_rows"]),
                    kept=int(engine.timings["draft_kept"]), kernels=engine.prepared.description)


def summary(seconds: list[float]) -> dict:
    t = 1e3 * np.asarray(seconds[WARMUP_PUSHES:])
    return dict(median_ms=float(np.median(t)), p95_ms=float(np.percentile(t, 95)), max_ms=float(t.max()))


def run_mode(ck, quantize: str | None, compare: str, audio: np.ndarray, pushes: int, rounds: int) -> dict:  # noqa: ANN001
    """The sides alternate; with drafts every round's events must equal the first's (same bits), with
    end_on_chunk each side's must equal its own first round's (the turns' audio differs between sides)."""
    sides: dict[str, list[dict]] = {"off": [], "on": []}
    reference: dict[str, list[str]] = {}
    for r in range(rounds):
        for side in ("off", "on"):
            got = session_run(ck, quantize, compare, side == "on", audio, pushes)
            key = "both" if compare == "drafts" else side
            events = got.pop("events")
            got["identical"] = events == reference.setdefault(key, events)
            got.update(summary(got["seconds"]))
            sides[side].append(got)
            print(f"  {quantize or 'none'} {compare} {side:>3} round {r + 1}: median {got['median_ms']:.0f} ms, p95 "
                  f"{got['p95_ms']:.0f} ms, max {got['max_ms']:.0f} ms; {got['kept']} of {got['guessed']} guessed "
                  f"tokens kept; events identical: {got['identical']}", flush=True)
    pooled = {side: _pooled(runs) for side, runs in sides.items()}
    return dict(quantize=quantize or "none", compare=compare, rounds=sides, pooled=pooled,
                verifies_drafts=sides["on"][0]["verifies"], kernels=sides["on"][0]["kernels"],
                all_identical=all(run["identical"] for runs in sides.values() for run in runs))


def _pooled(runs: list[dict]) -> dict:
    t = 1e3 * np.concatenate([np.asarray(run["seconds"][WARMUP_PUSHES:]) for run in runs])
    finals = 1e3 * np.asarray([x for run in runs for x in run["final_after_pause"]])
    return dict(pushes=int(t.size), median_ms=float(np.median(t)), p95_ms=float(np.percentile(t, 95)),
                max_ms=float(t.max()), guessed=sum(run["guessed"] for run in runs),
                kept=sum(run["kept"] for run in runs), finals=int(finals.size),
                final_after_pause_median_ms=float(np.median(finals)) if finals.size else None,
                final_after_pause_p95_ms=float(np.percentile(finals, 95)) if finals.size else None)


def print_table(results: list[dict], cpu: dict) -> None:
    print(f"\none live session, 1 s pushes as fast as they return; CPU: {cpu['model']} "
          f"(AMX: {'yes' if cpu['amx_bf16'] else 'no'})")
    compare = results[0]["compare"]
    print(f"| mode | {compare} | pushes | median ms | p95 ms | max ms | guessed tokens kept | p95 on / off "
          "| pause to final, real time: median / p95 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        off, on = res["pooled"]["off"], res["pooled"]["on"]
        for side, p in (("off", off), ("on", on)):
            kept = f"{p['kept']} of {p['guessed']}"
            ratio = f"{on['p95_ms'] / off['p95_ms']:.2f}" if side == "on" else ""
            finals = (f"{p['final_after_pause_median_ms']:.0f} / {p['final_after_pause_p95_ms']:.0f} "
                      f"({p['finals']} turns)" if p["finals"] else "-")
            print(f"| {res['quantize']} | {side} | {p['pushes']} | {p['median_ms']:.0f} | {p['p95_ms']:.0f} | "
                  f"{p['max_ms']:.0f} | {kept} | {ratio} | {finals} |")
    what = "on both sides" if compare == "drafts" else "on each side"
    print(f"events identical {what} in every round: "
          + ", ".join(f"{r['quantize']} {r['all_identical']}" for r in results))


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for res in results:
        for side, style in (("off", "--"), ("on", "-")):
            t = np.sort(1e3 * np.concatenate([np.asarray(run["seconds"][WARMUP_PUSHES:])
                                              for run in res["rounds"][side]]))
            ax.plot(t, np.arange(1, t.size + 1) / t.size, style,
                    label=f"{res['quantize']}, {res['compare']} {side}")
    ax.axhline(0.95, color="grey", lw=0.5)
    ax.axvline(500, color="grey", lw=0.5)
    ax.set_xlabel("push latency (ms)")
    ax.set_ylabel("fraction of pushes")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="0.6b", choices=("0.6b", "demo"))
    p.add_argument("--transcript", default="steady", choices=("steady", "words"))
    p.add_argument("--model", type=Path, help="a real checkpoint instead of a random one (e.g. models/qasr-demo-en)")
    p.add_argument("--quantize", nargs="+", default=["int4", "int8"], choices=("none", "int8", "int4"))
    p.add_argument("--compare", default="drafts", choices=tuple(COMPARED), help="what the sides differ in")
    p.add_argument("--pushes", type=int, default=150, help="1 s pushes per session (the first 5 not counted)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--name", default="")
    args = p.parse_args(argv)

    import soundfile as sf
    import torch
    from streaming import AUDIO, build_checkpoint

    from qasr.bench.perf.machine import cpu_info
    from qasr.model.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    model = args.model or build_checkpoint(args.cache, args.dims, args.transcript)
    ck = load_checkpoint(model, device="cpu", dtype="bfloat16")
    wave, sr = sf.read(AUDIO, dtype="float32")
    audio = np.tile(wave, math.ceil(args.pushes * sr / len(wave)) + 1)
    cpu = cpu_info()
    label = str(args.model) if args.model else f"random {args.dims} dims, {args.transcript}"
    print(f"{label}; {args.pushes} pushes x {args.rounds} rounds per side; {cpu['model']}", flush=True)
    results = [run_mode(ck, None if q == "none" else q, args.compare, audio, args.pushes, args.rounds)
               for q in args.quantize]
    print_table(results, cpu)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "live_drafts" if args.compare == "drafts" else f"live_{args.compare}"
    stem += f"_{args.name}" if args.name else ""
    for res in results:  # the per-push seconds stay in the JSON; the summary repeats them per round
        for runs in res["rounds"].values():
            for run in runs:
                run["seconds"] = [round(s, 5) for s in run["seconds"]]
                run["final_after_pause"] = [round(s, 5) for s in run["final_after_pause"]]
    (args.out / f"{stem}.json").write_text(json.dumps(dict(
        model=label, compare=args.compare, compared=COMPARED[args.compare], cpu=cpu, threads=args.threads,
        settings=SETTINGS, pushes=args.pushes, rounds=args.rounds,
        warmup_pushes=WARMUP_PUSHES, audio=str(Path(AUDIO).relative_to(ROOT)), results=results), indent=1))
    plot(results, f"{label}: one live session, {args.compare} off vs on ({cpu['model']}, {args.threads} threads)",
         args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")
    return 0 if all(r["all_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
