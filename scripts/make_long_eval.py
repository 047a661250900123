"""Long evaluation recordings for the demo model: 10-20 minutes of espeak-ng speech per file, with pauses,
long silences and a little noise, each with its reference transcript.

What a segment length is measured on (scripts/eval_segment_length.py): a recording cut into segments of
at most ``max_segment_s`` by the VAD. So each file is a conversation of turns: a voice (one of espeak-ng's
English accents x variants, a speed of 130-190 words per minute, a pitch) says 2-8 sentences with pauses
of 0.3-3 s between them, the next voice follows after a pause of the same kind, and 2-4 times per file a
long silence of 20-60 s falls between two sentences. Faint pink, white or brown noise (35-45 dB under
the speech) runs under the whole file, silences included.

The sentences come from the demo model's own grammar (make_demo_data.py's ``sentence``), so every word
is in its vocabulary, but none is one of its training sentences (the training split is rebuilt from that
script's seed and excluded) and none occurs twice across the files. Same seed, same files.

    .venv/bin/python scripts/make_long_eval.py --out data/long_eval --files 3 --minutes 12

Writes ``long_NN.wav`` (16 kHz mono PCM 16) and ``long_NN.txt`` (the reference: the sentences in order,
one line) per file, and ``manifest.json`` (each sentence's voice, speed and times in its file).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_data import (  # noqa: E402 - the script's own folder, put on the path just above
    SAMPLE_RATE,
    TEST_SENTENCES,
    TRAIN_ACCENTS,
    TRAIN_VARIANTS,
    espeak,
    make_noise,
    sentence,
    unique_sentences,
)

DEMO_DATA_SEED, DEMO_TRAIN_PLUS_VAL, DEMO_VAL = 1234, 16400, 400  # make_demo_data.py's defaults


def training_sentences() -> set[str]:
    """The demo model's training sentences, rebuilt exactly as make_demo_data.py draws them."""
    r = random.Random(DEMO_DATA_SEED)
    texts = unique_sentences(r, DEMO_TRAIN_PLUS_VAL, set(TEST_SENTENCES))
    r.shuffle(texts)
    return set(texts[DEMO_VAL:])


def new_sentences(r: random.Random, exclude: set[str]) -> Iterator[str]:
    """An endless supply of grammar sentences outside ``exclude`` (each handed out once; added to it)."""
    while True:
        s = sentence(r)
        if s not in exclude:
            exclude.add(s)
            yield s


def make_file(minutes: float, r: random.Random, rng: np.random.Generator,
              sentences: Iterator[str]) -> tuple[np.ndarray, list[dict]]:
    """One file of about ``minutes`` minutes: its samples and its sentences with their times."""
    voices = [f"{a}+{v}" if v else a for a in TRAIN_ACCENTS for v in TRAIN_VARIANTS]
    target = minutes * 60 * SAMPLE_RATE
    silences = r.randint(2, 4)
    # the long silences fall at random points of the file (as fractions of its planned length)
    silence_at = sorted(r.uniform(0.1, 0.9) for _ in range(silences))
    parts: list[np.ndarray] = [np.zeros(int(r.uniform(0.3, 2.0) * SAMPLE_RATE), np.float32)]
    rows: list[dict] = []
    t = len(parts[0])
    while t < target:
        voice, speed, pitch = r.choice(voices), r.randint(130, 190), r.randint(25, 75)
        level = 10 ** (r.uniform(-12, -3) / 20)  # each speaker's own loudness
        for _ in range(r.randint(2, 8)):
            text = next(sentences)
            wave, _ = espeak(text, voice, speed, pitch)
            wave = wave * (level / (np.abs(wave).max() + 1e-9))
            rows.append({"text": text, "voice": voice, "speed": speed, "pitch": pitch,
                         "start": round(t / SAMPLE_RATE, 3), "end": round((t + len(wave)) / SAMPLE_RATE, 3)})
            parts.append(wave.astype(np.float32))
            t += len(wave)
            if silence_at and t >= silence_at[0] * target:
                silence_at.pop(0)
                gap = r.uniform(20.0, 60.0)
            else:
                gap = r.uniform(0.3, 3.0)
            parts.append(np.zeros(int(gap * SAMPLE_RATE), np.float32))
            t += len(parts[-1])
            if t >= target:
                break
    wave = np.concatenate(parts)
    speech = np.concatenate([p for p in parts if p.any()])
    snr = r.uniform(35.0, 45.0)
    noise = make_noise(r.choice(("pink", "white", "brown")), len(wave), rng)
    wave = wave + noise * np.sqrt(np.mean(speech**2)) / 10 ** (snr / 20)
    return np.clip(wave, -1.0, 1.0).astype(np.float32), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the WAVs, transcripts and manifest")
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=12.0, help="length of each file (10-20 is the intent)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    r = random.Random(args.seed)
    rng = np.random.default_rng(args.seed)
    sentences = new_sentences(r, training_sentences() | set(TEST_SENTENCES))
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for i in range(args.files):
        wave, rows = make_file(args.minutes, r, rng, sentences)
        name = f"long_{i:02d}"
        sf.write(args.out / f"{name}.wav", wave, SAMPLE_RATE, subtype="PCM_16")
        (args.out / f"{name}.txt").write_text(" ".join(row["text"] for row in rows) + "\n")
        manifest.append({"wav": f"{name}.wav", "txt": f"{name}.txt", "duration": round(len(wave) / SAMPLE_RATE, 3),
                         "sentences": rows})
        words = sum(len(row["text"].split()) for row in rows)
        print(f"{name}: {len(wave) / SAMPLE_RATE / 60:.1f} min, {len(rows)} sentences, {words} words, "
              f"{len({row['voice'] for row in rows})} voices")
    (args.out / "manifest.json").write_text(json.dumps({"seed": args.seed, "files": manifest}, indent=1) + "\n")


if __name__ == "__main__":
    main()
