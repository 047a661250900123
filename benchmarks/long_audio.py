"""Long audio, side by side: one long file against the same audio as 1-minute files, and serial segments.

On a random checkpoint with the real Qwen3-ASR-0.6B dimensions (bf16, 4 forced output tokens per audio
second, EOS ignored, as in the throughput benchmark), each in its own process:

* ``long``: one N-minute file (espeak-ng speech with pauses) through ``ASR.transcribe``: VAD segments,
  all submitted to the engine together;
* ``files``: the same audio cut into N 1-minute files, in one ``transcribe`` call;
* ``serial``: the long file's first minutes, segment after segment, each waiting for the previous one
  (how the official package and vLLM's offline path run the pieces of a long file): the reference.

The ratio long / files should be near 1 (the long file is not processed serially); long / serial is
what batching the segments buys. Then the peak RSS of a 2-hour file (flac on disk, decoded in blocks)
against its waveform's size, with ``--rss-model`` (the demo model by default, because 2 hours on the
0.6B dimensions takes about 15 minutes here; ``--rss-model 0.6b`` measures that too).

    .venv/bin/python benchmarks/long_audio.py [--minutes 20] [--serial-minutes 4] [--rss-hours 2]

Prints a table, writes JSON and a PNG to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from qasr import TranscribeOptions
from qasr.bench.common import PeakRss, build_checkpoint, in_subprocess
from qasr.bench.perf.machine import ForeignCpu, cpu_info
from qasr.engine.engine import RequestSpec

ROOT = Path(__file__).resolve().parent.parent
SR = 16000
TOKENS_PER_SECOND = 4.0
SENTENCES = (
    "the meeting is on the fourth of march at three", "set an alarm for seven thirty tomorrow",
    "please send the report to the whole team before friday", "how much is twelve plus nine",
    "turn off the lights in the kitchen and lock the door", "remind me to call my sister tonight",
    "the weather will be cold and windy this weekend", "we need milk eggs bread and some coffee",
)


def speech_audio(seconds: float, workdir: Path, seed: int = 0) -> np.ndarray:
    """Seeded espeak-ng sentences separated by 0.3-3 s pauses, tiled to ``seconds``."""
    from qasr.testing.speech import speak

    rng = np.random.default_rng(seed)
    voices = ("en-us", "en-gb", "en-us+f3", "en-gb-scotland+m3")
    parts: list[np.ndarray] = []
    for k, sentence in enumerate(SENTENCES * 2):
        wav = speak(sentence, workdir / "s.wav", voice=voices[k % len(voices)], speed=int(rng.integers(140, 180)))
        wave, sr = sf.read(wav, dtype="float32")
        assert sr == 22050 or sr == SR, sr
        if sr != SR:
            import soxr

            wave = soxr.resample(wave, sr, SR)
        parts += [wave, np.zeros(int(SR * rng.uniform(0.3, 3.0)), np.float32)]
    unit = np.concatenate(parts)
    reps = int(np.ceil(seconds * SR / len(unit)))
    return np.tile(unit, reps)[: int(seconds * SR)]


def _asr(model: str, dtype: str):  # noqa: ANN202
    from qasr import ASR

    asr = ASR.from_pretrained(model, device="cpu", dtype=dtype, max_tokens_per_second=TOKENS_PER_SECOND)
    warm = np.zeros(SR * 2, np.float32)
    asr.transcribe((warm, SR), TranscribeOptions(max_new_tokens=4, ignore_eos=True))  # builds kernels, packs weights
    return asr


def run_batched(model: str, dtype: str, paths: list[str]) -> dict:
    """All inputs in one transcribe call; segments forced to ceil(4 x seconds) + 24 tokens."""
    asr = _asr(model, dtype)
    with ForeignCpu() as foreign, PeakRss() as rss:
        t0 = time.perf_counter()
        results = asr.transcribe(paths, TranscribeOptions(ignore_eos=True))
        wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    audio = sum(r.duration for r in results)
    return {"wall_s": wall, "audio_s": audio, "rtfx": audio / wall, "segments": sum(len(r.segments) for r in results),
            "tokens": sum(len(r.token_ids) for r in results), "peak_rss_gib": rss.peak / 2**30,
            "foreign_cpu": foreign.share}


def run_serial(model: str, dtype: str, path: str) -> dict:
    """The same segments, one request at a time (each waits for the previous one)."""
    asr = _asr(model, dtype)
    pieces = asr._core.prepare(path, TranscribeOptions(segmentation="vad"))
    tokens = 0
    with ForeignCpu() as foreign:
        t0 = time.perf_counter()
        for p in pieces:
            result = asr._core.engine.submit(RequestSpec(p.prompt, p.max_new_tokens, waveform=p.samples,
                                                   ignore_eos=True)).result()
            tokens += len(result.token_ids)
        wall = time.perf_counter() - t0
    audio = sf.info(path).duration
    return {"wall_s": wall, "audio_s": audio, "rtfx": audio / wall, "segments": len(pieces), "tokens": tokens,
            "foreign_cpu": foreign.share}


def run_rss(model: str, dtype: str, path: str) -> dict:
    """Peak RSS of transcribing one long file, against the process before it and the waveform's size."""
    asr = _asr(model, dtype)
    from qasr.bench.common import _vm_hwm

    base = _vm_hwm()
    t0 = time.perf_counter()
    with PeakRss() as rss:
        [result] = asr.transcribe(path, TranscribeOptions(max_new_tokens=8, ignore_eos=True))
    if result.error:
        raise RuntimeError(result.error)
    return {"wall_s": time.perf_counter() - t0, "audio_s": result.duration, "segments": len(result.segments),
            "base_rss_gib": base / 2**30, "peak_rss_gib": rss.peak / 2**30,
            "waveform_gib": result.duration * SR * 4 / 2**30}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    sides = [("serial", "segments one by one\n(reference)", "#999999"),
             ("files_result", f"{report['files']} x 1-min files", "#7fb3d5"),
             ("long", f"one {report['minutes']}-min file", "#2b7bba")]
    vals = [report[k]["rtfx"] for k, _, _ in sides]
    a.bar([label for _, label, _ in sides], vals, color=[c for _, _, c in sides])
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    a.set_ylabel("audio seconds per wall second (RTFx)")
    a.set_title(f"long / files wall ratio {report['long_over_files']:.2f}")
    r = report["rss"]
    b.bar(["before the file", "peak while\ntranscribing it", "before + its whole\nwaveform (float32)"],
          [r["base_rss_gib"], r["peak_rss_gib"], r["base_rss_gib"] + r["waveform_gib"]],
          color=["#bbbbbb", "#2b7bba", "#e08060"])
    b.set_ylabel("GiB")
    b.set_title(f"memory, {r['audio_s'] / 3600:.1f} h file ({report['rss_model']})")
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=int, default=20, help="length of the long file (default 20)")
    p.add_argument("--serial-minutes", type=float, default=4.0,
                   help="audio for the serial reference, from the long file's start (default 4)")
    p.add_argument("--rss-hours", type=float, default=2.0, help="length of the memory test file (default 2)")
    p.add_argument("--rss-model", default="demo", choices=("demo", "0.6b"),
                   help="model for the memory test (default: the bundled demo model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rss-only", action="store_true",
                   help="only the memory test (e.g. with --rss-model 0.6b, which takes a while)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    ckpt = str(build_checkpoint(args.cache))
    work = args.cache / f"long_audio_{args.minutes}min"
    work.mkdir(exist_ok=True)
    long_path = work / "long.flac"
    if not long_path.exists():
        print(f"making {args.minutes} minutes of speech ...", flush=True)
        wave = speech_audio(args.minutes * 60, work)
        sf.write(long_path, wave, SR)
        for k in range(args.minutes):
            sf.write(work / f"minute{k:02d}.flac", wave[k * 60 * SR:(k + 1) * 60 * SR], SR)
        sf.write(work / "serial.flac", wave[: int(args.serial_minutes * 60 * SR)], SR)
    minutes = [str(work / f"minute{k:02d}.flac") for k in range(args.minutes)]
    rss_path = work / f"rss_{args.rss_hours:g}h.flac"
    if not rss_path.exists():
        wave = sf.read(long_path, dtype="float32")[0]
        left = int(args.rss_hours * 3600 * SR)
        with sf.SoundFile(rss_path, "w", SR, 1) as f:  # written in blocks: the benchmark itself stays small
            while left > 0:
                f.write(wave[:left])
                left -= min(left, len(wave))

    cpu = cpu_info()["model"]
    report: dict = {"title": f"qasr long audio, 0.6B dims random bf16, {args.threads} threads, {cpu}",
                    "cpu": cpu, "minutes": args.minutes, "files": args.minutes, "tokens_per_second": TOKENS_PER_SECOND}
    if args.rss_only:
        rss_model = str(ROOT / "models" / "qasr-demo-en") if args.rss_model == "demo" else ckpt
        print(f"memory: {args.rss_hours:g} h file with the {args.rss_model} model ...", flush=True)
        report["rss"] = in_subprocess(run_rss, args.threads, rss_model, "bfloat16", str(rss_path))
        report["rss_model"] = "demo model" if args.rss_model == "demo" else "0.6B dims"
        m = report["rss"]
        print(f"memory ({report['rss_model']}): {m['audio_s'] / 3600:.2f} h file, {m['segments']} segments, "
              f"{m['wall_s']:.0f} s, RSS {m['base_rss_gib']:.2f} GiB before, {m['peak_rss_gib']:.2f} GiB peak; "
              f"its waveform alone would be {m['waveform_gib']:.2f} GiB")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        (args.out / f"long_audio_rss_{stamp}.json").write_text(json.dumps(report, indent=2))
        return 0
    print("one long file ...", flush=True)
    report["long"] = in_subprocess(run_batched, args.threads, ckpt, "bfloat16", [str(long_path)])
    print("1-minute files ...", flush=True)
    report["files_result"] = in_subprocess(run_batched, args.threads, ckpt, "bfloat16", minutes)
    print("serial segments (reference) ...", flush=True)
    report["serial"] = in_subprocess(run_serial, args.threads, ckpt, "bfloat16", str(work / "serial.flac"))
    rss_model = str(ROOT / "models" / "qasr-demo-en") if args.rss_model == "demo" else ckpt
    print(f"memory: {args.rss_hours:g} h file with the {args.rss_model} model ...", flush=True)
    report["rss"] = in_subprocess(run_rss, args.threads, rss_model, "bfloat16", str(rss_path))
    report["rss_model"] = "demo model" if args.rss_model == "demo" else "0.6B dims"
    report["long_over_files"] = report["long"]["wall_s"] / report["files_result"]["wall_s"]
    report["long_over_serial_rtfx"] = report["long"]["rtfx"] / report["serial"]["rtfx"]
    _print_table(report)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"long_audio_{stamp}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"long_audio_{stamp}.png")
    print(f"wrote {args.out}/long_audio_{stamp}.json and .png")
    print(f"long_over_files={report['long_over_files']:.2f} long_rtfx={report['long']['rtfx']:.1f} "
          f"serial_rtfx={report['serial']['rtfx']:.1f} rss_peak_gib={report['rss']['peak_rss_gib']:.2f}")
    return 0


def _print_table(report: dict) -> None:
    rows = [("one long file", report["long"]), (f"{report['files']} x 1-min files", report["files_result"]),
            ("serial segments (reference)", report["serial"])]
    print(f"\n{'side':<30}{'audio s':>9}{'segments':>10}{'tokens':>8}{'wall s':>9}{'RTFx':>7}{'peak GiB':>10}")
    for name, r in rows:
        print(f"{name:<30}{r['audio_s']:>9.0f}{r['segments']:>10}{r['tokens']:>8}{r['wall_s']:>9.1f}{r['rtfx']:>7.1f}"
              f"{r.get('peak_rss_gib', float('nan')):>10.2f}")
    m = report["rss"]
    print(f"\nmemory ({report['rss_model']}): {m['audio_s'] / 3600:.2f} h file, {m['segments']} segments, "
          f"RSS {m['base_rss_gib']:.2f} GiB before, {m['peak_rss_gib']:.2f} GiB peak; its waveform alone would be "
          f"{m['waveform_gib']:.2f} GiB")
    print(f"long / files wall ratio: {report['long_over_files']:.2f}; "
          f"long RTFx / serial RTFx: {report['long_over_serial_rtfx']:.2f}\n")


if __name__ == "__main__":
    raise SystemExit(main())
