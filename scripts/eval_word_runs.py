"""WER of demo models on short random word runs by voices and speeds they never trained on, side by side.

Why: the end-to-end test (tests/e2e/test_demo_model.py) speaks 24 such runs, too few to tell a model that
passes its 10% bar by luck from one that passes it by a margin. This speaks the same kinds of runs (6-9 number
words, or codes of 5-7 letters and digits, in random order: no sentence to lean on) for many seeds, with
the test's held-out voices and speeds (outside the 130-190 wpm of the training data), and transcribes them
through ``qasr.ASR`` with each model given. The WER is also split by voice: one voice the model cannot
hear hides behind an average over four.

``--voice VOICE:WPM`` (repeatable) has every run spoken by each voice given instead, at that speed, to see
how a model does on voices a user might pick (any espeak-ng voice, e.g. ``en-gb-x-rp+f2:230``).

    .venv/bin/python scripts/eval_word_runs.py models/qasr-demo-en /tmp/other-model --seeds 10
    .venv/bin/python scripts/eval_word_runs.py models/qasr-demo-en --seeds 4 --voice en-us:175 --voice en+m3:110
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jiwer
import torch

from qasr import ASR
from qasr.testing.word_runs import FIRST_SEED, UNSEEN_VOICES, speak_runs_by, speak_word_runs, word_runs


def part(refs: list[str], hyps: list[str], ids: list[int]) -> float:
    return jiwer.wer([refs[i] for i in ids], [hyps[i] for i in ids])


def voice_speed(text: str) -> tuple[str, int]:
    """``"en-us+m3:110"`` -> ("en-us+m3", 110)."""
    voice, _, wpm = text.rpartition(":")
    if not voice or not wpm.isdigit():
        raise argparse.ArgumentTypeError(f"expected VOICE:WPM, e.g. en-us+m3:110, got {text!r}")
    return voice, int(wpm)


def spoken(runs: list[str], voices: list[tuple[str, int]], folder: Path) -> tuple[list[str], list[Path], list[str]]:
    """References, audio files and the voice of each file.

    Without ``voices``: each run once, the test's voices taken in turn (as the test speaks them). With
    ``voices``: every run by every voice.
    """
    if not voices:
        labels = [":".join(map(str, UNSEEN_VOICES[i % len(UNSEEN_VOICES)])) for i in range(len(runs))]
        return runs, speak_word_runs(runs, folder), labels
    refs, paths, labels = [], [], []
    for voice, wpm in voices:
        paths += speak_runs_by(runs, voice, wpm, folder)
        refs += runs
        labels += [f"{voice}:{wpm}"] * len(runs)
    return refs, paths, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, default=10,
                    help="8 runs per seed, from FIRST_SEED on (the test draws the first 3)")
    ap.add_argument("--voice", action="append", type=voice_speed, default=[], metavar="VOICE:WPM",
                    help="speak every run with this espeak-ng voice at this speed (repeatable); "
                         "default: the test's held-out voices in turn")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [FIRST_SEED + k for k in range(args.seeds)]
    runs = [t for s in seeds for t in word_runs(s)]
    with tempfile.TemporaryDirectory() as tmp:
        refs, paths, labels = spoken(runs, args.voice, Path(tmp))
        print(f"{len(refs)} spoken runs ({sum(len(t.split()) for t in refs)} words), seeds {seeds[0]}..{seeds[-1]}")
        results: dict[Path, list[str]] = {}
        print("| model | WER all | number words | letter/digit codes | worst seed (8 runs) | runs with errors |")
        print("|---|---|---|---|---|---|")
        for model in args.models:
            asr = ASR.from_pretrained(model, device="cpu", dtype="float32")
            try:
                hyps = results[model] = [" ".join(r.text.lower().split()) for r in asr.transcribe(paths)]
            finally:
                asr.close()
            numbers = [i for i in range(len(refs)) if i % 8 < 4]
            codes = [i for i in range(len(refs)) if i % 8 >= 4]
            per_seed = [jiwer.wer(refs[8 * k:8 * k + 8], hyps[8 * k:8 * k + 8]) for k in range(len(refs) // 8)]
            wrong = sum(a != b for a, b in zip(refs, hyps, strict=True))
            print(f"| {model} | {jiwer.wer(refs, hyps):.1%} | {part(refs, hyps, numbers):.1%} "
                  f"| {part(refs, hyps, codes):.1%} "
                  f"| {max(per_seed):.1%} | {wrong} of {len(refs)} |")
        voices = list(dict.fromkeys(labels))
        print("\nWER by voice:\n")
        print("| voice:wpm | " + " | ".join(str(m) for m in args.models) + " |")
        print("|---|" + "---|" * len(args.models))
        for voice in voices:
            ids = [i for i, label in enumerate(labels) if label == voice]
            print(f"| {voice} | " + " | ".join(f"{part(refs, results[m], ids):.1%}" for m in args.models) + " |")


if __name__ == "__main__":
    main()
