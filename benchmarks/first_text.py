"""When a long file's text starts: its first segment with and without a lead, against serial segments.

On a random checkpoint with the real Qwen3-ASR-0.6B dimensions (bf16, 4 forced output tokens per audio
second, EOS ignored, as in long_audio.py), each side in its own process, the same VAD pieces submitted at
once in one group (their log-mel made before the clock starts):

* ``lead``: the first piece is the group's lead (``RequestSpec(lead=True)``), as a streamed call marks it;
* ``no lead``: no piece leads, as a call whose results come whole (and the engine before the lead);
* ``transcribe_segments``: the API a caller streams with, on the same file (it cuts and submits the pieces as
  it decodes the file, the first as the lead);
* ``serial``: the pieces one after another, each waiting for the previous one (how the official package
  and vLLM's offline path run a long file's pieces): the reference, over the first --serial-minutes.

The lead and no-lead sides alternate, --repeats times each. Reported: when the first segment is done (and
its share of the run), the whole run, RTFx (audio seconds covered over the wall time).

    .venv/bin/python benchmarks/first_text.py [--minutes 9] [--repeats 2] [--serial-minutes 3]

Prints a table, writes JSON and a PNG to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import soundfile as sf
from long_audio import SR, TOKENS_PER_SECOND, speech_audio

from qasr import TranscribeOptions
from qasr.bench.common import build_checkpoint, in_subprocess
from qasr.bench.perf.machine import ForeignCpu, cpu_info
from qasr.engine.engine import RequestSpec

ROOT = Path(__file__).resolve().parent.parent


def _asr(model: str):  # noqa: ANN202
    from qasr import ASR

    asr = ASR.from_pretrained(model, device="cpu", dtype="bfloat16", max_tokens_per_second=TOKENS_PER_SECOND)
    warm = np.zeros(SR * 2, np.float32)
    asr.transcribe((warm, SR), TranscribeOptions(max_new_tokens=4, ignore_eos=True))  # builds kernels, packs weights
    return asr


def _pieces(asr, path: str, minutes: float | None = None) -> list:  # noqa: ANN001
    """The file's VAD pieces with their log-mel (those starting in the first ``minutes``)."""
    pieces = asr._core.prepare(path, TranscribeOptions(segmentation="vad", ignore_eos=True))
    if minutes is not None:
        pieces = [p for p in pieces if p.offset < minutes * 60] or pieces[:1]
    return pieces


def _spec(piece, group: object, lead: bool) -> RequestSpec:  # noqa: ANN001
    audio = {"waveform": piece.samples} if piece.features is None else {"features": piece.features}
    return RequestSpec(piece.prompt, piece.max_new_tokens, ignore_eos=True, group=group, lead=lead, **audio)


def run_together(model: str, path: str, lead: bool) -> dict:
    """Every piece submitted at once in one group; the first one the lead if ``lead``."""
    asr = _asr(model)
    pieces = _pieces(asr, path)
    engine = asr._core.engine
    done = [0.0] * len(pieces)
    group = object()
    with ForeignCpu() as foreign:
        t0 = time.perf_counter()
        futures = []
        for k, piece in enumerate(pieces):
            fut = engine.submit(_spec(piece, group, lead and k == 0))
            fut.add_done_callback(lambda _, k=k: done.__setitem__(k, time.perf_counter() - t0))
            futures.append(fut)
        tokens = sum(len(f.result().token_ids) for f in futures)
        wall = time.perf_counter() - t0
    in_order = list(np.maximum.accumulate(done))  # when pieces 0..k are all done: what a stream can show
    audio = sf.info(path).duration
    return {"wall_s": wall, "first_s": done[0], "first_share": done[0] / wall, "in_order_s": in_order,
            "segments": len(pieces), "tokens": tokens, "audio_s": audio, "rtfx": audio / wall,
            "foreign_cpu": foreign.share}


def run_api(model: str, path: str) -> dict:
    """``ASR.transcribe_segments`` over the file: when each segment is handed over."""
    asr = _asr(model)
    with ForeignCpu() as foreign:
        t0 = time.perf_counter()
        times = []
        stream = asr.transcribe_segments(path, TranscribeOptions(segmentation="vad", ignore_eos=True))
        for _ in stream:
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t0
    tokens, audio = len(stream.transcription.token_ids), stream.transcription.duration
    return {"wall_s": wall, "first_s": times[0], "first_share": times[0] / wall, "in_order_s": times,
            "segments": len(times), "tokens": tokens, "audio_s": audio, "rtfx": audio / wall,
            "foreign_cpu": foreign.share}


def run_serial(model: str, path: str, minutes: float) -> dict:
    """The pieces of the first ``minutes``, each submitted once the previous one is done."""
    asr = _asr(model)
    pieces = _pieces(asr, path, minutes)
    engine = asr._core.engine
    done = []
    with ForeignCpu() as foreign:
        t0 = time.perf_counter()
        tokens = 0
        for piece in pieces:
            tokens += len(engine.submit(_spec(piece, None, False)).result().token_ids)
            done.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t0
    audio = pieces[-1].offset + pieces[-1].duration  # the stretch of the file they cover
    return {"wall_s": wall, "first_s": done[0], "in_order_s": done, "segments": len(pieces), "tokens": tokens,
            "audio_s": audio, "rtfx": audio / wall, "foreign_cpu": foreign.share}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in (("lead", "tab:blue"), ("no lead", "tab:orange"), ("transcribe_segments", "tab:green")):
        for k, run in enumerate(report["runs"][name]):
            ax.step(run["in_order_s"], range(1, run["segments"] + 1), where="post", color=color, alpha=0.8,
                    label=name if k == 0 else None)
    serial = report["serial"]
    ax.step(serial["in_order_s"], range(1, serial["segments"] + 1), where="post", color="tab:gray",
            label=f"serial (reference, first {report['serial_minutes']:g} min)")
    ax.set_xlabel("seconds since submission")
    ax.set_ylabel("segments shown in order")
    ax.set_title(report["title"], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=9.0, help="length of the file (default 9)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each of the lead and no-lead sides (default 2)")
    p.add_argument("--serial-minutes", type=float, default=3.0,
                   help="audio for the serial reference, from the file's start (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.repeats < 1 or args.serial_minutes <= 0:
        p.error("--minutes and --serial-minutes must be positive, --repeats at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    ckpt = str(build_checkpoint(args.cache))
    path = args.cache / f"first_text_{args.minutes:g}min.flac"
    if not path.exists():
        print(f"making {args.minutes:g} minutes of speech ...", flush=True)
        work = args.cache / "first_text_speech"
        work.mkdir(exist_ok=True)
        sf.write(path, speech_audio(args.minutes * 60, work), SR)
    cpu = cpu_info()["model"]
    report: dict = {"title": f"qasr first text of a {args.minutes:g}-minute file, 0.6B dims random bf16, "
                             f"{args.threads} threads, {cpu}",
                    "cpu": cpu, "minutes": args.minutes, "serial_minutes": args.serial_minutes,
                    "tokens_per_second": TOKENS_PER_SECOND,
                    "runs": {"lead": [], "no lead": [], "transcribe_segments": []}}
    for k in range(args.repeats):
        for name in ("lead", "no lead", "transcribe_segments") if k % 2 == 0 else ("no lead", "lead",
                                                                                  "transcribe_segments"):
            print(f"{name}, run {k + 1} of {args.repeats} ...", flush=True)
            if name == "transcribe_segments":
                report["runs"][name].append(in_subprocess(run_api, args.threads, ckpt, str(path)))
            else:
                report["runs"][name].append(in_subprocess(run_together, args.threads, ckpt, str(path),
                                                          name == "lead"))
    print("serial segments (reference) ...", flush=True)
    report["serial"] = in_subprocess(run_serial, args.threads, ckpt, str(path), args.serial_minutes)
    for name in ("lead", "no lead", "transcribe_segments"):
        runs = report["runs"][name]
        report[name] = {key: statistics.median(r[key] for r in runs)
                        for key in ("first_s", "first_share", "wall_s", "rtfx")}
    report["wall_lead_over_no_lead"] = report["lead"]["wall_s"] / report["no lead"]["wall_s"]
    _print_table(report)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"first_text_{stamp}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"first_text_{stamp}.png")
    print(f"wrote {args.out}/first_text_{stamp}.json and .png")
    lead, no_lead = report["lead"], report["no lead"]
    print(f"first_text_lead_s={lead['first_s']:.1f} ({lead['first_share']:.0%}) "
          f"first_text_no_lead_s={no_lead['first_s']:.1f} ({no_lead['first_share']:.0%}) "
          f"api_first_s={report['transcribe_segments']['first_s']:.1f} "
          f"serial_first_s={report['serial']['first_s']:.1f} "
          f"wall_lead_over_no_lead={report['wall_lead_over_no_lead']:.3f}")
    return 0


def _print_table(report: dict) -> None:
    print(f"\n{'side':<28}{'segments':>9}{'first text s':>14}{'share':>7}{'wall s':>8}{'RTFx':>7}{'others CPU':>11}")
    for name in ("lead", "no lead", "transcribe_segments"):
        for r in report["runs"][name]:
            print(f"{name:<28}{r['segments']:>9}{r['first_s']:>14.2f}{r['first_share']:>7.0%}{r['wall_s']:>8.1f}"
                  f"{r['rtfx']:>7.1f}{r['foreign_cpu']:>11.0%}")
    s = report["serial"]
    print(f"{'serial (reference)':<28}{s['segments']:>9}{s['first_s']:>14.2f}{'':>7}{s['wall_s']:>8.1f}"
          f"{s['rtfx']:>7.1f}{s['foreign_cpu']:>11.0%}")
    print(f"\nmedians: lead first text {report['lead']['first_s']:.2f} s, no lead {report['no lead']['first_s']:.2f} "
          f"s; wall lead / no lead {report['wall_lead_over_no_lead']:.3f}\n")


if __name__ == "__main__":
    raise SystemExit(main())
