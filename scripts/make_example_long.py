"""Make examples/briefing.flac: a minute of espeak-ng speech, pauses of 0.5-4 s and 12 s of silence.

`make demo` transcribes it to show the long-audio path: VAD segments, their times, an .srt file.
The sentences are in the demo model's vocabulary but none is a training sentence (they are the
held-out TEST_SENTENCES of make_demo_data.py). Deterministic: same output on every run.

    .venv/bin/python scripts/make_example_long.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from qasr.testing.speech import speak

SR = 16000
OUT = Path(__file__).resolve().parent.parent / "examples" / "briefing.flac"
SCRIPT = (  # (sentence, voice, words per minute, pause after it in seconds)
    ("set an alarm for six forty five", "en-us", 160, 0.8),
    ("call anna on the ninth of july", "en-us", 160, 1.5),
    ("the code is k four z nine", "en-gb", 150, 0.6),
    ("turn off the lights in the bedroom", "en-gb", 150, 12.0),
    ("remind me to buy milk tomorrow morning", "en-us+f3", 170, 2.0),
    ("what is the weather like in paris on friday", "en-us+f3", 170, 0.5),
    ("book a table for three people at eight thirty", "en-us", 155, 4.0),
    ("it costs twelve dollars and fifty cents", "en-gb", 150, 1.0),
)


def main() -> None:
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for sentence, voice, speed, pause in SCRIPT:
            wave, sr = sf.read(speak(sentence, Path(tmp) / "s.wav", voice=voice, speed=speed), dtype="float32")
            parts += [0.6 * soxr.resample(wave, sr, SR), np.zeros(int(pause * SR), np.float32)]
    sf.write(OUT, np.concatenate(parts).astype(np.float32), SR, subtype="PCM_16")
    print(f"wrote {OUT} ({sum(len(p) for p in parts) / SR:.1f} s)")


if __name__ == "__main__":
    main()
