"""WER of demo models on short random word runs by voices and speeds they never trained on, side by side.

Why: the end-to-end test (tests/test_demo_model.py) speaks 24 such runs, too few to tell a model that
passes its 10% bar by luck from one that passes it by a margin. This speaks the same kinds of runs (6-9 number
words, or codes of 5-7 letters and digits, in random order: no sentence to lean on) for many seeds, with
the test's held-out voices and speeds (outside the 130-190 wpm of the training data), and transcribes them
through ``qasr.ASR`` with each model given.

    .venv/bin/python scripts/eval_word_runs.py models/qasr-demo-en /tmp/other-model --seeds 10
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jiwer
import torch

from qasr import ASR
from qasr.testing.word_runs import FIRST_SEED, speak_word_runs, word_runs


def part(refs: list[str], hyps: list[str], ids: list[int]) -> float:
    return jiwer.wer([refs[i] for i in ids], [hyps[i] for i in ids])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, default=10,
                    help="8 runs per seed, from FIRST_SEED on (the test draws the first 3)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [FIRST_SEED + k for k in range(args.seeds)]
    runs = [t for s in seeds for t in word_runs(s)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = speak_word_runs(runs, Path(tmp))
        print(f"{len(runs)} runs ({sum(len(t.split()) for t in runs)} words), seeds {seeds[0]}..{seeds[-1]}")
        print("| model | WER all | number words | letter/digit codes | worst seed (8 runs) | runs with errors |")
        print("|---|---|---|---|---|---|")
        for model in args.models:
            asr = ASR.from_pretrained(model, device="cpu", dtype="float32")
            try:
                hyps = [" ".join(r.text.lower().split()) for r in asr.transcribe(paths)]
            finally:
                asr.close()
            numbers = [i for i in range(len(runs)) if i % 8 < 4]
            codes = [i for i in range(len(runs)) if i % 8 >= 4]
            per_seed = [jiwer.wer(runs[8 * k:8 * k + 8], hyps[8 * k:8 * k + 8]) for k in range(len(seeds))]
            wrong = sum(a != b for a, b in zip(runs, hyps, strict=True))
            print(f"| {model} | {jiwer.wer(runs, hyps):.1%} | {part(runs, hyps, numbers):.1%} "
                  f"| {part(runs, hyps, codes):.1%} "
                  f"| {max(per_seed):.1%} | {wrong} of {len(runs)} |")


if __name__ == "__main__":
    main()
