"""`make demo`: transcribe the bundled example clips offline.

Until a trained demo checkpoint is bundled under models/, this builds a tiny checkpoint with RANDOM
weights on the fly: the pipeline (decode, features, encoder, decoder, parser) runs for real, but the
text it prints is meaningless. Pass a real checkpoint directory to hear real words:
    .venv/bin/python examples/demo.py /path/to/Qwen3-ASR-0.6B
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from qasr import ASR

HERE = Path(__file__).resolve().parent
BUNDLED = HERE.parent / "models" / "qasr-demo-en"


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
    print(note)
    asr = ASR.from_pretrained(model_dir)
    start = time.perf_counter()
    results = asr.transcribe(clips)
    elapsed = time.perf_counter() - start
    for clip, r in zip(clips, results, strict=True):
        shown = r.text if r.error is None else f"ERROR {r.error}"
        print(f"{clip.name} ({r.duration:.1f} s) [{r.language or '?'}]: {shown}")
    audio = sum(r.duration for r in results)
    print(f"{audio:.1f} s of audio in {elapsed:.2f} s on {asr.checkpoint.device} ({asr.checkpoint.dtype})")
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
