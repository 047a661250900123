"""`make demo`: transcribe the bundled example clips with the bundled demo model.

The three short clips go to the model whole; `briefing.flac` (43 s, made by scripts/make_example_long.py)
is cut into speech segments by voice activity, its segments are printed with their times (and their
words' start times when the demo aligner models/qasr-demo-aligner-en is bundled) and its subtitles are
written to out/demo/briefing.srt. Pass another checkpoint directory to use it instead:
    .venv/bin/python examples/demo.py /path/to/Qwen3-ASR-0.6B
Without the bundled model (a bare source tree), a tiny checkpoint with RANDOM weights is made on the fly:
the pipeline runs for real, but its text is noise.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from qasr import ASR
from qasr.outputs.writers import render, write_atomic

HERE = Path(__file__).resolve().parent
BUNDLED = HERE.parent / "models" / "qasr-demo-en"
ALIGNER = HERE.parent / "models" / "qasr-demo-aligner-en"


def main() -> int:
    clips = sorted(HERE.glob("*.flac"))
    if len(sys.argv) > 1:
        model_dir, note = Path(sys.argv[1]), f"model: {sys.argv[1]}"
    elif (BUNDLED / "config.json").exists():
        model_dir, note = BUNDLED, f"model: {BUNDLED.relative_to(HERE.parent)} (bundled demo model)"
    else:
        from qasr.testing import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
        note = "model: a tiny checkpoint with RANDOM weights made on the fly -- the text below is noise"
    # word times when the demo aligner is bundled too (it knows the demo model's English only)
    aligner = ALIGNER if model_dir == BUNDLED and (ALIGNER / "config.json").exists() else None
    if aligner is not None:
        note += f"\naligner: {ALIGNER.relative_to(HERE.parent)} (bundled demo aligner: word times)"
    print(note)
    asr = ASR.from_pretrained(model_dir, aligner=aligner)
    start = time.perf_counter()
    results = asr.transcribe(clips, timestamps="word" if aligner else "segment")
    elapsed = time.perf_counter() - start
    out_dir = HERE.parent / "out" / "demo"
    for clip, r in zip(clips, results, strict=True):
        shown = r.text if r.error is None else f"ERROR {r.error}"
        print(f"{clip.name} ({r.duration:.1f} s) [{r.language or '?'}]: {shown}")
        if r.error is None and len(r.segments) > 1:
            for seg in r.segments:
                print(f"    {seg.start:6.2f} - {seg.end:6.2f} s  {seg.text}")
                if seg.words:
                    print("        " + " ".join(f"{w.text}@{w.start:.2f}" for w in seg.words))
            srt = out_dir / f"{clip.stem}.srt"
            write_atomic(srt, render(r, "srt"))
            print(f"    subtitles: {srt.relative_to(HERE.parent)}")
    audio = sum(r.duration for r in results)
    print(f"{audio:.1f} s of audio in {elapsed:.2f} s")
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
