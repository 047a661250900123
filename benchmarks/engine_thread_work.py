"""Work kept off the engine's thread and the event loop, measured side by side in one process.

1. words: the demo ASR model steps a long request (ignore_eos, a stand-in for live captions) while pieces
   with word timestamps finish beside it; each engine step's duration is recorded with the word chaining on
   its own thread (as shipped) and on the engine's thread (the former placement, by running the hand-over
   inline), with the real unit split and with one slowed to 0.5 s (nagisa's first import takes seconds).
2. log-mel: what one utterance's log-mel costs on this machine, the work a step used to do at a piece's
   first encoder slice.
3. sse: the streamed text of one piece, token by token, decoded from the start at each token (the former
   PieceText) against the incremental PieceText: seconds and ids decoded.

    .venv/bin/python benchmarks/engine_thread_work.py [--pieces 12] [--out docs/bench/engine_thread_work.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch

from qasr import ASR, TranscribeOptions
from qasr.align import aligner as aligner_module
from qasr.audio.features import LogMel
from qasr.engine.request import RequestSpec
from qasr.model.prompt import ASR_TEXT_TAG
from qasr.server.sse import PieceText

ROOT = Path(__file__).resolve().parent.parent
SR = 16000
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights in the bedroom", "remind me to buy milk tomorrow morning")


def speech(n: int) -> list[np.ndarray]:
    from qasr.testing.speech import speak

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(n):
            wave, sr = sf.read(speak(SENTENCES[k % len(SENTENCES)], Path(tmp) / "s.wav"), dtype="float32")
            out.append(soxr.resample(wave, sr, SR).astype(np.float32))
    return out


def step_times(engine: object) -> tuple[list[float], Callable[[], None]]:
    """Every step's seconds from now on; call the second value to stop recording."""
    owner = getattr(engine, "core", engine)  # the loop calls owner.step()
    real = owner.step
    times: list[float] = []

    def timed() -> None:
        t0 = time.perf_counter()
        real()
        times.append(time.perf_counter() - t0)

    owner.step = timed
    return times, lambda: delattr(owner, "step")


def words_run(asr: ASR, clips: list[np.ndarray], background: np.ndarray, inline: bool, slow: float) -> dict:
    core = asr._core
    split = aligner_module.split_units
    if slow:
        def slowed(text: str, language: str | None = None) -> list[str]:
            time.sleep(slow)
            return split(text, language)
        aligner_module.split_units = slowed
    worker_submit = core.words._worker.submit
    if inline:  # the chain runs in the ASR future's done-callback, as it did
        core.words._worker.submit = lambda fn, *a: fn(*a)
    try:
        [long] = core.prepare((background, SR), TranscribeOptions(language="English", segmentation="none"))
        started = threading.Event()
        other = core.engine.submit(RequestSpec(long.prompt, 4000, features=long.features, ignore_eos=True),
                                   on_token=lambda _: started.set())
        pieces = [p for c in clips for p in core.prepare((c, SR), TranscribeOptions(language="English",
                                                                                     segmentation="none"))]
        assert started.wait(120)  # the background request decodes
        times, stop = step_times(core.engine)
        t0 = time.perf_counter()
        futures = [core.submit(p, words=True) for p in pieces]
        results = [f.result(timeout=600) for f in futures]
        wall = time.perf_counter() - t0
        stop()
        other.cancel()
    finally:
        aligner_module.split_units = split
        core.words._worker.submit = worker_submit
    assert all(r.words for r in results), "a piece got no words"
    times.sort()
    return {"chain": "engine thread" if inline else "own thread", "split_delay_s": slow, "pieces": len(pieces),
            "wall_s": round(wall, 3), "steps": len(times), "step_median_ms": round(1e3 * statistics.median(times), 2),
            "step_p99_ms": round(1e3 * times[int(0.99 * (len(times) - 1))], 2),
            "step_max_ms": round(1e3 * times[-1], 2)}


def log_mel_costs(threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    lm = LogMel()
    rng = np.random.default_rng(0)
    out = []
    for minutes in (1, 10, 20):
        x = (rng.standard_normal(minutes * 60 * SR) * 0.1).astype(np.float32)
        lm(x[:SR])  # warm
        best = min(_timed(lambda x=x: lm(x)) for _ in range(3))
        out.append({"audio_min": minutes, "threads": threads, "log_mel_ms": round(1e3 * best, 1)})
    return out


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class FromScratch:
    """The former PieceText: the whole piece decoded again at every burst."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.ids, self.text = decode, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        raw = self.decode(self.ids)
        if ASR_TEXT_TAG not in raw:
            return ""
        settled = raw.split(ASR_TEXT_TAG, 1)[1].strip()
        while settled.endswith("\ufffd"):
            settled = settled[:-1].rstrip()
        if not settled.startswith(self.text):
            return ""
        new, self.text = settled[len(self.text):], settled
        return new


def sse_costs(asr: ASR) -> list[dict]:
    tok = asr._core.checkpoint.tokenizer
    rng = random.Random(0)
    out = []
    for n in (500, 2000, 8000):
        ids = tok.encode("language English") + [tok.token_to_id(ASR_TEXT_TAG)]
        while len(ids) < n:
            ids += tok.encode(" " + rng.choice(SENTENCES))
        ids = ids[:n]
        row: dict = {"tokens": n}
        texts = []
        for name, make in (("from_scratch", FromScratch), ("incremental", lambda d: PieceText(d, False))):
            decoded = [0]

            def decode(batch: list[int], decoded: list[int] = decoded) -> str:
                decoded[0] += len(batch)
                return tok.decode(batch, skip_special_tokens=True)

            text = make(decode)
            t0 = time.perf_counter()
            texts.append("".join(text.push(i) for i in ids))
            row[f"{name}_s"] = round(time.perf_counter() - t0, 4)
            row[f"{name}_ids_decoded"] = decoded[0]
        assert texts[0] == texts[1]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_thread_work.json")
    args = ap.parse_args()
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32",
                              aligner=ROOT / "models" / "qasr-demo-aligner-en")
    clips = speech(args.pieces)
    background = np.concatenate(clips[:3])
    words = []
    for slow in (0.0, 0.5):
        for inline in (True, False, True, False):  # alternating: the machine's speed moves
            words.append(words_run(asr, clips, background, inline, slow))
            print(words[-1], flush=True)
    mel = log_mel_costs(asr._core.engine.threads)
    for row in mel:
        print(row, flush=True)
    sse = sse_costs(asr)
    for row in sse:
        print(row, flush=True)
    asr.close()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "threads": asr._core.engine.threads, "words": words,
                                    "log_mel": mel, "sse": sse}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
