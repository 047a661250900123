"""What word confidence (``Word.probability``) costs, side by side in one process.

The bundled demo model and demo aligner transcribe a set of espeak-ng clips with ``timestamps="word"``,
in alternating rounds with the token-to-word mapping (``qasr.transcribe.word_confidence``) patched out
(words returned as they are) and in; the machine's speed moves, so only the rounds' ratio is reported,
with the time spent inside the mapping itself.

    .venv/bin/python benchmarks/word_confidence_cost.py [--rounds 6] [--clips 24]

Prints a table and writes JSON to --out (default benchmarks/results/word_confidence_cost.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

import qasr.transcribe.assemble as assemble
from qasr import ASR

ROOT = Path(__file__).resolve().parent.parent
SR = 16000
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights in the bedroom", "remind me to buy milk tomorrow morning",
             "what is the weather like in paris on friday", "book a table for three people at eight thirty",
             "it costs twelve dollars and fifty cents")


def clips(n: int) -> list[np.ndarray]:
    from qasr.testing.speech import speak

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(n):
            parts = []
            for j in range(1 + k % 3):  # one to three sentences: 2-9 s
                wave, sr = sf.read(speak(SENTENCES[(k + j) % len(SENTENCES)], Path(tmp) / "s.wav",
                                         speed=140 + 5 * (k % 8)), dtype="float32")
                parts += [soxr.resample(wave, sr, SR).astype(np.float32), np.zeros(SR // 2, np.float32)]
            out.append(np.concatenate(parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clips", type=int, default=24)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "word_confidence_cost.json")
    args = ap.parse_args()
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype=args.dtype,
                              aligner=ROOT / "models" / "qasr-demo-aligner-en")
    audio = [(w, SR) for w in clips(args.clips)]
    real = assemble.with_probabilities
    inside = [0.0]

    def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - with_probabilities' own arguments
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            inside[0] += time.perf_counter() - t0

    def run(on: bool) -> dict:
        assemble.with_probabilities = timed if on else (lambda words, *a, **kw: words)
        inside[0] = 0.0
        t0 = time.perf_counter()
        results = asr.transcribe(audio, timestamps="word")
        wall = time.perf_counter() - t0
        words = sum(len(s.words) for r in results for s in r.segments)
        scored = sum(w.probability is not None for r in results for s in r.segments for w in s.words)
        return {"wall_s": wall, "mapping_s": inside[0], "words": words, "scored": scored}

    run(True)  # warm-up
    rounds: dict[str, list[dict]] = {"without": [], "with": []}
    for r in range(args.rounds):
        for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
            rounds[side].append(run(side == "with"))
    assemble.with_probabilities = real
    asr.close()
    med = {side: statistics.median(x["wall_s"] for x in rs) for side, rs in rounds.items()}
    mapping = statistics.median(x["mapping_s"] for x in rounds["with"])
    words = rounds["with"][0]["words"]
    seconds = sum(len(w) for w, _ in audio) / SR
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"{args.clips} clips, {seconds:.0f} s of audio, {words} words ({rounds['with'][0]['scored']} scored); "
          f"{cpu} (AMX: {'yes' if amx else 'no'})")
    print(f"| median of {args.rounds} rounds | without | with | ratio | inside the mapping |")
    print("|---|---|---|---|---|")
    print(f"| wall (s) | {med['without']:.3f} | {med['with']:.3f} | {med['with'] / med['without']:.3f} | "
          f"{mapping * 1000:.1f} ms ({mapping / words * 1e6:.0f} us per word) |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "amx": amx, "clips": args.clips, "audio_s": round(seconds, 1),
                                    "words": words, "median_wall_s": med, "median_mapping_s": mapping,
                                    "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
