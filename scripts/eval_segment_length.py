"""WER and throughput of the demo model against the segment length, on long recordings.

A long input is cut by the VAD into segments of at most ``max_segment_s`` (docs/segmentation.md); this
measures what that limit costs or buys: each dtype loads the model once, then for every length the same
files go through one ``ASR.transcribe(files, TranscribeOptions(max_segment_s=S))`` call (the public API,
batched as a user gets it), timed from the call to its return. WER (jiwer) is computed on lower-cased text
with punctuation stripped, per file and over all files together (errors over reference words). Throughput is
audio seconds per wall second of that call. The files come from scripts/make_long_eval.py (WAV + .txt per file).

    .venv/bin/python scripts/make_long_eval.py --out data/long_eval --files 3 --minutes 12
    .venv/bin/python scripts/eval_segment_length.py --data data/long_eval

Writes docs/bench/segment_length_<cpu>.json (``--out`` to change it). Machines here are shared: the
throughput column moves with the load; the WER does not (greedy decoding, same audio).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import unicodedata
from datetime import date
from pathlib import Path

import jiwer
import numpy as np
import torch

from qasr import ASR, TranscribeOptions

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (8.0, 12.0, 15.0, 20.0, 30.0)


def normalize(text: str) -> str:
    """Lower-cased, punctuation and symbols to spaces, spaces collapsed."""
    text = unicodedata.normalize("NFKC", text.lower())
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text)
    return " ".join(text.split())


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_slug() -> str:
    """How bench files name the machine: amd, xeon_amx, xeon, or the first word of the model name."""
    name = cpu_model().lower()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amd" in name or "epyc" in name:
        return "amd"
    if "xeon" in name:
        return "xeon_amx" if re.search(r"\bamx_tile\b", flags) else "xeon"
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")[:24] or "cpu"


def measures(refs: list[str], hyps: list[str]) -> dict:
    out = jiwer.process_words([normalize(r) for r in refs], [normalize(h) for h in hyps])
    return {"wer": round(out.wer, 5), "words": sum(len(normalize(r).split()) for r in refs),
            "substitutions": out.substitutions, "deletions": out.deletions, "insertions": out.insertions}


def run(asr: ASR, files: list[Path], refs: list[str], audio_s: float, max_segment_s: float) -> dict:
    start = time.perf_counter()
    results = asr.transcribe([str(f) for f in files], TranscribeOptions(max_segment_s=max_segment_s))
    wall = time.perf_counter() - start
    for f, t in zip(files, results, strict=True):
        if t.error:
            raise SystemExit(f"{f}: {t.error}")
    lengths = [s.end - s.start for t in results for s in t.segments]
    return {
        "max_segment_s": max_segment_s,
        "overall": measures(refs, [t.text for t in results]),
        "files": {f.name: measures([r], [t.text]) for f, r, t in zip(files, refs, results, strict=True)},
        "segments": len(lengths),
        "segment_s_mean": round(float(np.mean(lengths)), 2),
        "segment_s_max": round(float(np.max(lengths)), 2),
        "cut_at_length_cap": sum(s.finish_reason == "length" for t in results for s in t.segments),
        "wall_s": round(wall, 2),
        "audio_s_per_wall_s": round(audio_s / wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a folder of NAME.wav + NAME.txt (make_long_eval.py)")
    ap.add_argument("--model", default=str(ROOT / "models" / "qasr-demo-en"))
    ap.add_argument("--dtypes", default="float32,auto",
                    help="comma list; auto is the CPU's default; NAME:int8 or NAME:int4 loads that dtype "
                         "quantized (docs/quantization.md)")
    ap.add_argument("--lengths", default=",".join(f"{s:g}" for s in LENGTHS), help="max_segment_s values, seconds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (machines here are shared)")
    ap.add_argument("--out", type=Path, default=None, help="default docs/bench/segment_length_<cpu>.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    files = sorted(args.data.glob("*.wav"))
    if not files:
        raise SystemExit(f"{args.data}: no .wav files")
    refs = [f.with_suffix(".txt").read_text().strip() for f in files]
    import soundfile as sf

    audio_s = sum(sf.info(str(f)).duration for f in files)
    lengths = [float(s) for s in args.lengths.split(",")]
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": date.today().isoformat(),
              "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "model": args.model,
              "files": [f.name for f in files], "audio_s": round(audio_s, 1),
              "reference_words": sum(len(normalize(r).split()) for r in refs), "runs": []}
    print(f"{len(files)} files, {audio_s / 60:.1f} min of audio; {cpu_model()}, {args.threads} thread(s)")
    print(f"{'dtype':>9} {'max_s':>5} {'WER%':>6} {'sub':>4} {'del':>4} {'ins':>4} {'segs':>5} {'mean_s':>6} "
          f"{'audio_s/s':>9}  per file WER%")
    for name in args.dtypes.split(","):
        asked, _, quantize = name.strip().partition(":")
        asr = ASR.from_pretrained(args.model, device="cpu", dtype=asked, quantize=quantize or None)
        dtype = str(asr._core.checkpoint.dtype).removeprefix("torch.") + (f":{quantize}" if quantize else "")
        warm, sr = sf.read(str(files[0]), frames=60 * 16000, dtype="float32")
        asr.transcribe((warm, sr), TranscribeOptions(max_segment_s=8.0))  # warm-up: kernels, VAD, pools
        for s in lengths:
            row = {"dtype": dtype, "dtype_asked": name.strip(), **run(asr, files, refs, audio_s, s)}
            report["runs"].append(row)
            o = row["overall"]
            per_file = " ".join(f"{v['wer'] * 100:.2f}" for v in row["files"].values())
            print(f"{dtype:>9} {s:>5g} {o['wer'] * 100:>6.2f} {o['substitutions']:>4} {o['deletions']:>4} "
                  f"{o['insertions']:>4} {row['segments']:>5} {row['segment_s_mean']:>6} "
                  f"{row['audio_s_per_wall_s']:>9}  {per_file}", flush=True)
        asr.close()
    out = args.out or ROOT / "docs" / "bench" / f"segment_length_{cpu_slug()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
