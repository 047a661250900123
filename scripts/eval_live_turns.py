"""Live transcription's word error rate with and without ``LiveConfig.end_on_chunk``, on one stream.

The validation split's sentence clips (``scripts/make_demo_data.py --splits val``) are joined into one stream
with pauses of ``--min-gap``-``--max-gap`` seconds between them (long enough to end a turn: 500 ms of silence),
pushed through ``ASR.live`` 1 s at a time, as a microphone would send it. The turns' final
transcripts, joined, are scored against the clips' texts joined (the stream's WER), for each setting, and
beside them the offline transcript of each clip (``ASR.transcribe``) for scale.

    .venv/bin/python scripts/make_demo_data.py --out /tmp/demo_val --splits val
    .venv/bin/python scripts/eval_live_turns.py --data /tmp/demo_val [--clips 80] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_demo_model import word_errors  # noqa: E402

from qasr import ASR, TranscribeOptions  # noqa: E402
from qasr.audio.io import SAMPLE_RATE as SR  # noqa: E402
from qasr.streaming import LiveConfig, StreamConfig, TurnFinal  # noqa: E402


def live_text(asr: ASR, stream: np.ndarray, chunk_s: float, end_on_chunk: bool) -> tuple[str, int, float]:
    """The joined final transcripts of the stream's turns, the turn count, and the seconds it took."""
    live = asr.live(LiveConfig(StreamConfig(chunk_size_sec=chunk_s), end_on_chunk=end_on_chunk))
    finals: list[str] = []
    start = time.perf_counter()
    for i in range(0, len(stream), SR):
        finals += [e.text for e in live.push(stream[i:i + SR]) if isinstance(e, TurnFinal)]
    finals += [e.text for e in live.finish() if isinstance(e, TurnFinal)]
    return " ".join(t for t in finals if t), len(finals), time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qasr-demo-en")
    ap.add_argument("--data", type=Path, required=True, help="a directory made by make_demo_data.py")
    ap.add_argument("--split", default="val")
    ap.add_argument("--clips", type=int, default=80, help="sentence clips in the stream")
    ap.add_argument("--min-gap", type=float, default=0.6)
    ap.add_argument("--max-gap", type=float, default=1.6)
    ap.add_argument("--chunk-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    rows = [json.loads(line) for line in (args.data / f"{args.split}.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "sentence"][:args.clips]
    rng = np.random.default_rng(args.seed)
    clips = [sf.read(args.data / r["path"], dtype="float32")[0] for r in rows]
    pieces = []
    for clip in clips:
        pieces += [clip, np.zeros(int(rng.uniform(args.min_gap, args.max_gap) * SR), dtype=np.float32)]
    stream = np.concatenate(pieces)
    reference = " ".join(r["text"] for r in rows)

    asr = ASR.from_pretrained(args.model)
    offline = [s.text for s in asr.transcribe(clips, TranscribeOptions(sample_rate=SR))]
    result = {"clips": len(clips), "stream_s": round(len(stream) / SR, 1), "chunk_s": args.chunk_s,
              "offline_wer": word_errors([r["text"] for r in rows], offline)[0]}
    for option in (False, True):
        text, turns, seconds = live_text(asr, stream, args.chunk_s, option)
        wer, words = word_errors([reference], [text])
        result[f"end_on_chunk_{'on' if option else 'off'}"] = {"wer": wer, "words": words, "turns": turns,
                                                               "seconds": round(seconds, 1)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
