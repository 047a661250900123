"""Random runs of the demo grammar's words (no sentence to lean on), spoken by voices and at speeds the demo
model never trained on: the same for the end-to-end test and scripts/eval_word_runs.py."""

from __future__ import annotations

import random
from pathlib import Path

from qasr.testing.speech import speak

# voices held out of make_demo_data.py's training data, at speeds outside its range
UNSEEN_VOICES = (("en-us-nyc+f5", 122), ("en-gb-x-gbcwmd+m7", 198), ("en-us-nyc+m7", 200),
                 ("en-gb-x-gbcwmd+f5", 125))
NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety").split()
DIGITS = NUMBER_WORDS[:10]
LETTERS = list("bcdefghijklmnopqrstuvwxyz")  # no "a": espeak-ng reads it as the article
FIRST_SEED = 20240611
PITCH = 45  # espeak-ng's 0-100 scale, inside the training data's 25-75


def word_runs(seed: int) -> list[str]:
    """Eight runs for one seed: four of 6-9 number words, then four codes of 5-7 letters and digits."""
    r = random.Random(seed)
    runs = [" ".join(r.choice(NUMBER_WORDS) for _ in range(r.randint(6, 9))) for _ in range(4)]
    runs += [" ".join(r.choice(LETTERS) if r.random() < 0.5 else r.choice(DIGITS) for _ in range(r.randint(5, 7)))
             for _ in range(4)]
    return runs


def speak_word_runs(runs: list[str], folder: Path) -> list[Path]:
    """WAV files of ``runs``, UNSEEN_VOICES taken in turn."""
    return [speak(text, folder / f"run{i}.wav", voice=voice, speed=wpm, pitch=PITCH)
            for i, text in enumerate(runs) for voice, wpm in [UNSEEN_VOICES[i % len(UNSEEN_VOICES)]]]


def speak_runs_by(runs: list[str], voice: str, wpm: int, folder: Path) -> list[Path]:
    """WAV files of ``runs``, all by one espeak-ng voice at one speed."""
    return [speak(text, folder / f"{voice}_{wpm}_run{i}.wav", voice=voice, speed=wpm, pitch=PITCH)
            for i, text in enumerate(runs)]
