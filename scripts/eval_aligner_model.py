"""Word-boundary error of the demo aligner on held-out clips, through ``qasr.Aligner.align``.

The truth is espeak-ng's word times from make_aligner_data.py (each word's audible span). Reported: the
mean absolute error of word starts and of word ends (ms), their median and 90th percentile, and the
share of boundaries within 80 ms (one class), overall, for training voices vs held-out voices, and per
kind of clip. All clips go to the aligner in one call, batched by its engine, as a user would send them.

    .venv/bin/python scripts/eval_aligner_model.py --data data/aligner --model models/qasr-demo-aligner-en \\
        --update-card
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from qasr import Aligner


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def summary(errors: np.ndarray) -> str:
    """errors: (n, 2) absolute start/end errors in seconds."""
    ms = errors * 1000
    return (f"start **{ms[:, 0].mean():.0f} ms**, end **{ms[:, 1].mean():.0f} ms** mean absolute error "
            f"(median {np.median(ms[:, 0]):.0f} / {np.median(ms[:, 1]):.0f} ms, 90th percentile "
            f"{np.percentile(ms[:, 0], 90):.0f} / {np.percentile(ms[:, 1], 90):.0f} ms; "
            f"{100 * (ms <= 80).mean():.0f}% of boundaries within 80 ms; {len(ms)} words)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data/aligner"))
    ap.add_argument("--model", type=Path, default=Path("models/qasr-demo-aligner-en"))
    ap.add_argument("--split", default="val")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--update-card", action="store_true", help="write the figures into the model card")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (args.data / f"{args.split}.jsonl").read_text().splitlines()]
    with Aligner.from_pretrained(args.model, device="cpu", dtype="bfloat16") as aligner:
        aligner.align([args.data / rows[0]["path"]], [rows[0]["text"]], "English")  # warm-up
        start = time.time()
        found = aligner.align([args.data / r["path"] for r in rows], [r["text"] for r in rows], "English")
        seconds = time.time() - start
    train_voices = {json.loads(line)["voice"] for line in (args.data / "train.jsonl").read_text().splitlines()}
    errors: dict[tuple[str, str], list[np.ndarray]] = {}
    for row, words in zip(rows, found, strict=True):
        assert [w.text for w in words] == [w for w, _, _ in row["words"]], (row["text"], words)
        err = np.abs(np.array([[w.start, w.end] for w in words]) - np.array([[a, b] for _, a, b in row["words"]]))
        group = "training voices" if row["voice"] in train_voices else "held-out voices"
        for key in (("all", ""), ("voices", group), ("kind", row["kind"]), (row["kind"], group)):
            errors.setdefault(key, []).append(err)
    audio = sum(r["duration"] for r in rows)
    kinds = {"sentence": "single sentences", "multi": "several sentences with pauses (up to 30 s)",
             "words": "random word runs (held-out voices and speeds)"}
    lines = [f"Measured by `scripts/eval_aligner_model.py` through `qasr.Aligner.align` on the `{args.split}` split "
             f"({len(rows)} clips, {audio / 60:.1f} min; sentences never seen in training) against espeak-ng's "
             f"word times:", "",
             f"- all: {summary(np.concatenate(errors[('all', '')]))}"]
    for key in ("training voices", "held-out voices"):
        if ("voices", key) in errors:
            lines.append(f"- {key}: {summary(np.concatenate(errors[('voices', key)]))}")
    lines.append("- by kind of clip:")
    for kind, label in kinds.items():
        if ("kind", kind) in errors:
            lines.append(f"  - {label}: {summary(np.concatenate(errors[('kind', kind)]))}")
            groups = [g for g in ("training voices", "held-out voices") if (kind, g) in errors]
            if len(groups) > 1:  # the word runs are all by held-out voices: no split to show
                lines += [f"    - {g}: {summary(np.concatenate(errors[(kind, g)]))}" for g in groups]
    lines.append(f"- speed: {audio:.0f} s of audio in {seconds:.1f} s (cpu, bfloat16, {args.threads} thread(s), "
                 f"one batched align() call; {cpu_name()})")
    text = "\n".join(lines)
    print(text)
    if args.update_card:
        card = args.model / "README.md"
        old = card.read_text()
        head, rest = old.split("<!-- eval:start -->")
        card.write_text(f"{head}<!-- eval:start -->\n{text}\n<!-- eval:end -->{rest.split('<!-- eval:end -->')[1]}")
        print(f"updated {card}")


if __name__ == "__main__":
    main()
