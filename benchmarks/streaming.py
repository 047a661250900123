"""Live streaming, side by side: qasr's incremental sessions against the naive official algorithm.

All sides run in one process, on the same model, audio and settings: 1 s steps (``chunk_size_sec=1``),
the official ``unfixed_chunk_num=2`` and ``unfixed_token_num=5``, and ``max_new_tokens=9`` per step.

* ours (Session, one unbroken turn): ``ASR.stream`` (``qasr.streaming.Session``): keeps log-mel frames,
  closed 8 s encoder windows and the decoder KV of the prompt head between steps;
* ours (LiveSession, VAD turns), with ``--live``: ``ASR.live`` (``qasr.streaming.LiveSession``), the
  product path for long streams: the VAD cuts the stream into turns, each a fresh Session;
* naive official (one unbroken turn): ``qasr.streaming.OracleStream``, the official algorithm written
  plainly: every step is a fresh request over all the audio so far (log-mel, encoder, whole prompt).

In one unbroken turn the official algorithm feeds the previous output minus its last 5 tokens back as
the answer's start, so the text prefix grows with the stream (about 4 tokens a second of speech) and is
prefilled again every step: both unbroken sides' step cost grows with the stream. A LiveSession's grows
only with its open turn.

1. **Step cost against elapsed stream time.** Ours (Session) is pushed every 1 s chunk of a ``--minutes``
   stream, step after step, as fast as it goes. The naive side is sampled at ``--naive-at`` seconds: just
   before ours takes step t, an OracleStream is given ours' state (the first t-1 s of audio and the
   previous step's raw output, which decide the prefix) and takes step t alone. Both then ran the same
   step; their prompts and generated ids are compared (they must be equal).
2. **Real-time streams at minute ``--at``.** N streams, one thread each, all on the one engine, each
   pushing a 1 s chunk when its audio is complete (phases spread evenly over the second); latency = time
   from that moment to the moment push() returns. Streams start at ``--at`` seconds: ours (Session)
   from a session given the state of step ``--at - 2`` (audio and raw output, from run 1) that then
   takes two unmeasured steps (the first re-encodes everything; the check that its tokens equal run 1's
   is recorded); naive from an OracleStream given the state of step ``--at``. Then ``--measure`` steps
   per stream are timed. N doubles from 1 while 95% of all steps answer within ``--limit-ms``, then is
   bisected; a trial stops early once that is impossible.
3. **The production path, ``--live``** (``--live-only``: without ours (Session)).
   *Step cost*: one LiveSession with the default LiveConfig (turn detection on: a turn ends after 500 ms
   of silence, at its next chunk boundary (``end_on_chunk``), at the first silent frame past
   ``soft_turn_s`` 30 s, at ``max_turn_s`` 60 s whatever is said; ``carry_context`` off) gets every 1 s
   chunk as fast as it goes, to ``--minutes``. Per push:
   its wall time, the work of the turn steps it caused (steps, log-mel frames, encoder rows, prompt
   tokens prefilled, summed; the last step's prompt, audio and prefix tokens), whether a turn was open
   before and after it, the open turn's length. Silence costs the VAD only. The turn Sessions are read
   through the LiveSession's private ``_turn`` / ``_start_turn`` (the public API reports events, not
   work; the wrapper only notes each turn's Session). The audio's sentences are a few seconds long, so
   its turns are too; the *bound* run gives the cost a turn can reach: a LiveSession without turn
   detection, whose one turn runs to ``max_turn_s`` (the same audio, ``max_turn_s`` + 2 pushes).
   Compared with the naive samples of run 1 at the same t.
   *Real-time streams*: N LiveSessions on the one engine, pushed as in run 2, each fresh (nothing to
   set up: earlier turns are closed and a LiveSession keeps nothing of them; ``carry_context``, off by
   default, would carry the last ``carried_chars`` = 500 characters of committed text into the next
   turn's context, and a fresh session would lack it). A fresh session is in the continuous one's state
   only where no turn is open, so each starts at s: the last multiple of 4 s at or before ``--at`` where
   the step-cost session had no turn open during the next second (4 s: the VAD's 32 ms frames then lie
   on the same samples; starting inside a turn would drop its start and understate its cost). Each
   measures ``--live-measure`` pushes from s (default 45: one loop of the audio, so every phase of its
   turns); whether stream 0's turns match the step-cost session's is recorded. N is searched as in
   run 2, next to the naive side's figure of run 2, and their ratio.
   With ``--live-only`` the naive samples and run 2's naive streams cannot take ours' state; they start
   from a synthetic previous output of the length one unbroken turn has there (exact for the random
   checkpoints: every step generates ``max_new_tokens`` ids, so after k steps the raw output holds
   9 + 4(k - 2) word tokens, or nothing with ``--transcript empty``; the words differ, the token counts
   and so the work are the same). Whenever run 1 runs too, the synthetic prompt is checked against the
   real one at each naive sample (``synthetic_prompt_matches``).

``--budget-minutes M`` bounds the wall time (split evenly over the models): the live step-cost run
takes at most 40% of what is left when it starts (its per-push cost is periodic, so a cut run loses
only minutes); the bound run is skipped unless twice the dearest push so far, for each of its pushes,
fits; naive samples are taken in increasing t and one is skipped (with all later ones) when its
predicted time (the last sample's x (t / t_last)^1.3 x ``--repeats``) would eat into the time kept for
run 2; a stream search stops when its next trial would not fit (its figure is then a lower bound,
marked). The production path against the naive one at the 0.6B dims, on 2 cores (the unbroken Session
run alone takes well over an hour there, so it is left out):

    .venv/bin/python benchmarks/streaming.py --dims 0.6b --live-only --naive-at 60 300 600 --repeats 1 \\
        --budget-minutes 20 --name streaming_live_0.6b

Estimated 10-15 minutes on an idle 2-core AMD EPYC (the demo-dims smoke run's work counts priced at
the 0.6B dims' per-token costs measured on that machine; the budget caps it at 20). There a LiveSession
step that decodes takes about 0.5 s and the naive step at 5 minutes tens of seconds, so with the
default ``--limit-ms 500`` both sides may sustain 0 real-time streams (reported as such, with no ratio).

The models are random checkpoints at given dimensions (``--dims``: ``0.6b``, the real Qwen3-ASR-0.6B
dims, and ``demo``, the bundled demo model's dims), seeded, bf16, built once in ``--cache``. One change
to the random weights: the LM head rows of every token but the test tokenizer's 54 whole-word tokens
(" the", " world", ...) are zero, so greedy decoding picks words, never EOS or byte soup. So every step
generates exactly ``max_new_tokens`` and the generated text feeds back as the next prefix the way a
transcript does: with 9 new tokens and 5 rolled back, the prefix grows 4 tokens (about 3 words) per
second of audio, like speech. ``--model DIR`` runs a real checkpoint as it is instead (not with
``--live-only``).

Audio: examples/briefing.flac (42.6 s of espeak-ng speech with pauses and 12 s of silence), looped.

    .venv/bin/python benchmarks/streaming.py                  # 0.6B and demo dims, 10 min: hours on 2 cores
    .venv/bin/python benchmarks/streaming.py --quick          # demo dims, 2 min streams: a smoke run
    .venv/bin/python benchmarks/streaming.py --quick --live   # the same with the LiveSession side
    .venv/bin/python benchmarks/streaming.py --model models/qasr-demo-en --minutes 3

Prints tables, writes JSON and a PNG to --out (default docs/bench/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qasr.engine.config import QUANTIZE_CHOICES  # plain data, no torch

ROOT = Path(__file__).resolve().parent.parent
SR = 16000
AUDIO = ROOT / "examples" / "briefing.flac"
DEMO = ROOT / "models" / "qasr-demo-en"
SETTINGS = dict(chunk_size_sec=1.0, unfixed_chunk_num=2, unfixed_token_num=5)
BUSY = 0.2  # others' share of the CPUs above which a failed real-time trial is run once more
SIDES = {  # the names every table, plot and JSON file uses, so no figure can be read as the other side's
    "ours": "ours (Session, one unbroken turn)",
    "live": "ours (LiveSession, VAD turns)",
    "naive": "naive official (one unbroken turn)",
}
VAD_ALIGN_S = 4  # 4 s = 125 VAD frames of 512 samples: a session started there sees the same frames
LIVE_SHARE = 0.4  # of the budget left when it starts, what the live step-cost run may take
NAIVE_GROWTH = 1.3  # predicted naive step time ~ t ** this (linear work plus attention over the prompt)


# ------------------------------------------------------------------------------------------- models
def dims_of(name: str) -> dict[str, int]:
    if name == "0.6b":
        from qasr.testing import QWEN3_ASR_0_6B_DIMS

        return dict(QWEN3_ASR_0_6B_DIMS)
    if name == "demo":  # the bundled demo model's dimensions, from its config
        cfg = json.loads((DEMO / "config.json").read_text())["thinker_config"]
        a, t = cfg["audio_config"], cfg["text_config"]
        return dict(d_model=a["d_model"], encoder_layers=a["encoder_layers"],
                    encoder_attention_heads=a["encoder_attention_heads"], encoder_ffn_dim=a["encoder_ffn_dim"],
                    downsample_hidden_size=a["downsample_hidden_size"], hidden_size=t["hidden_size"],
                    intermediate_size=t["intermediate_size"], num_hidden_layers=t["num_hidden_layers"],
                    num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
                    head_dim=t["head_dim"], vocab_size=t["vocab_size"])
    raise ValueError(f"unknown dims {name!r} (0.6b or demo)")


def build_checkpoint(cache: Path, dims: str, transcript: str = "words") -> Path:
    """The random checkpoint at ``dims`` that speaks ``transcript`` (qasr.testing.speaking), built once in
    ``cache``: every step generates its ``max_new_tokens`` ids, never EOS."""
    from qasr.testing.speaking import speaking_checkpoint

    return speaking_checkpoint(cache / f"streaming-{dims}-dims-random-{transcript}-hf", dims_of(dims), transcript)


def speech(seconds: float) -> np.ndarray:
    import soundfile as sf

    wave, sr = sf.read(AUDIO, dtype="float32")
    assert sr == SR, sr
    return np.tile(wave, math.ceil(seconds * SR / len(wave)) + 1)[: int(seconds * SR) + SR]


class Budget:
    """A wall-clock deadline for the parts of a run that can be skipped or cut short. It is a
    ``time.time()`` instant, not a perf counter, because it is set in the parent and read in the
    model's subprocess."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.time()

    def allows(self, seconds: float, reserve: float = 0.0) -> bool:
        return seconds + reserve <= self.left()


# -------------------------------------------------------------------------------------- the two sides
def set_state(stream, state: dict) -> None:  # noqa: ANN001
    """Give a fresh Session or OracleStream the text state of a stream after ``state['steps']`` steps:
    the previous raw output and the chunk count decide the next prefix (qasr.streaming.steps.StreamText).
    The public API has no way to start a stream mid-way, so this sets the fields directly."""
    st = stream.state
    st.raw, st.chunk_id, st.steps = state["raw"], state["chunk_id"], state["steps"]
    st.language, st.text = stream.state.prompts.parse(state["raw"])


def ours_at(asr, settings: dict, audio: np.ndarray, state: dict):  # noqa: ANN001, ANN201
    """A Session holding the first ``state['steps']`` chunks of ``audio`` as decoded, and that state's
    text: its next push is step steps+1 (encoding everything, as no window is kept yet)."""
    from qasr.streaming import StreamConfig

    s = asr.stream(StreamConfig(**settings))
    n = s.config.chunk_size_samples * state["steps"]
    s.audio.append(audio[:n])
    s.consumed = n
    set_state(s, state)
    return s


def naive_at(asr, settings: dict, audio: np.ndarray, state: dict):  # noqa: ANN001, ANN201
    from qasr.streaming import OracleStream, StreamConfig

    o = OracleStream(asr._core.engine, asr._core.checkpoint, StreamConfig(**settings))
    o.audio = audio[: o.config.chunk_size_samples * state["steps"]].copy()
    set_state(o, state)
    return o


def snapshot(stream) -> dict:  # noqa: ANN001
    st = stream.state
    return {"raw": st.raw, "chunk_id": st.chunk_id, "steps": st.steps}


def synthetic_state(asr, settings: dict, steps: int, words: list[int] | None) -> dict:  # noqa: ANN001
    """The text state of one unbroken turn after ``steps`` steps of a random checkpoint, without taking
    them: every step generates ``max_new_tokens`` ids (``words``: whole words, in the order given, cycled;
    None: ids that decode to nothing), after the prefix the official rule leaves of the last output."""
    m, u, unfixed = settings["max_new_tokens"], settings["unfixed_token_num"], settings["unfixed_chunk_num"]
    n = 0  # raw output tokens after step k (0-based; step k runs with chunk_id k)
    for k in range(steps):
        n = (max(n - u, 0) if k >= unfixed else 0) + m
    raw = asr._core.checkpoint.tokenizer.decode([words[i % len(words)] for i in range(n)]) if words else ""
    return {"raw": raw, "chunk_id": steps, "steps": steps, "synthetic": True}


def prompt_len(asr, settings: dict, state: dict) -> int:  # noqa: ANN001
    """The prompt length (for one audio token) of the step after ``state``: what its text adds."""
    o = naive_at(asr, settings, np.zeros(0, dtype=np.float32), state)
    return len(o.state.prompts(1, o.state.prefix()))


def work_of(asr, result, prefill: int | None = None) -> dict:  # noqa: ANN001
    """What a step held: prompt tokens, audio tokens, text prefix tokens (a naive step prefills all)."""
    audio_id = asr._core.checkpoint.special.audio_pad
    n_audio = sum(1 for t in result.prompt if t == audio_id)
    return {"prompt": len(result.prompt), "audio_tokens": n_audio,
            "prefix_tokens": len(asr._core.checkpoint.tokenizer.encode(result.prefix)) if result.prefix else 0,
            "generated": len(result.generated), "prefill": len(result.prompt) if prefill is None else prefill}


def naive_step(asr, audio: np.ndarray, settings: dict, t: int, state: dict, repeats: int) -> dict:  # noqa: ANN001
    """Step t of the naive algorithm from ``state`` (after step t-1), ``repeats`` times, each by a fresh
    OracleStream (the same work; the median is reported). ``res`` (the last StepResult) is returned
    for the comparison with ours and dropped before the row is stored."""
    from qasr.bench.perf.machine import ForeignCpu

    cs = int(settings["chunk_size_sec"] * SR)
    hop = asr._core.checkpoint.features.hop_length
    times, shares = [], []
    for _ in range(repeats):
        o = naive_at(asr, settings, audio, state)
        with ForeignCpu() as foreign:
            t0 = time.perf_counter()
            [res] = o.push(audio[(t - 1) * cs:t * cs])
            times.append(time.perf_counter() - t0)
        shares.append(foreign.share)
    row = dict(t=t, seconds=float(np.median(times)), all_seconds=times, frames=len(o.audio) // hop,
               encoder_rows=work_of(asr, res)["audio_tokens"], foreign_cpu=float(np.mean(shares)),
               state="synthetic" if state.get("synthetic") else "from ours (Session)", **work_of(asr, res))
    print(f"  naive step at {t:>4} s: {' '.join(f'{x:.2f}' for x in times)} s, prefill {row['prefill']} "
          f"tokens, others' CPU {row['foreign_cpu']:.0%}{' (synthetic state)' if state.get('synthetic') else ''}",
          flush=True)
    return dict(row, res=res)


# ----------------------------------------------------------------------------------- 1. step cost
def step_cost(asr, audio: np.ndarray, settings: dict, steps: int, naive_times: list[int],  # noqa: ANN001
              repeats: int, keep_states: set[int], keep_tokens: set[int], partial: Path | None = None) -> dict:
    """Ours through every step; at each of ``naive_times``, the naive step taken ``repeats`` times from
    ours' state (each by a fresh OracleStream: the same work; the median is reported). ``keep_states``:
    steps k whose state before step k is returned; ``keep_tokens``: steps whose generated ids are
    returned (for run 2). ``partial``: where the rows so far are written every minute (a long run on a
    shared machine may be cut short)."""
    from qasr.bench.perf.machine import ForeignCpu
    from qasr.streaming import StreamConfig

    cs = int(settings["chunk_size_sec"] * SR)
    s = asr.stream(StreamConfig(**settings))
    ours, naive, states, tokens, naive_states = [], [], {}, {}, {}
    t_start = time.perf_counter()
    for k in range(1, steps + 1):
        chunk = audio[(k - 1) * cs:k * cs]
        if k in keep_states:
            states[k] = snapshot(s)
        pending = None
        if k in naive_times:
            naive_states[k] = snapshot(s)
            pending = naive_step(asr, audio, settings, k, naive_states[k], repeats)
            naive.append(pending)
        with ForeignCpu() as foreign:
            t0 = time.perf_counter()
            s.push(chunk)
            dt = time.perf_counter() - t0
        r, st = s.results[-1], s.stats
        ours.append(dict(t=k, seconds=dt, frames=st.frames[-1], encoder_rows=st.encoder_tokens[-1],
                         conv_chunks=st.conv_chunks[-1], windows_recomputed=st.windows_recomputed[-1],
                         foreign_cpu=foreign.share,
                         **work_of(asr, r, st.prefill_tokens[-1])))
        if k in keep_tokens:
            tokens[k] = tuple(r.generated)
        if pending is not None:
            res = pending.pop("res")
            pending["same_tokens_as_ours"] = bool(res.prompt == r.prompt and res.generated == r.generated)
        if k % 60 == 0:
            last = ours[-60:]
            med = np.median([x["seconds"] for x in last])
            print(f"  {SIDES['ours']} at {k // 60:>2} min: median step {med:.3f} s, "
                  f"prefill {last[-1]['prefill']}, prefix {last[-1]['prefix_tokens']} tokens "
                  f"({time.perf_counter() - t_start:.0f} s so far)", flush=True)
            if partial is not None:
                partial.write_text(json.dumps({"ours": ours, "naive": naive}) + "\n")
    s.close()
    return {"ours": ours, "naive": naive, "states": states, "tokens": tokens, "naive_states": naive_states}


def naive_samples(asr, audio: np.ndarray, settings: dict, times: list[int], repeats: int,  # noqa: ANN001
                  words: list[int] | None, budget: Budget, reserve: Callable[[list[dict]], float]) -> dict:
    """The naive samples without ours (Session): each from a synthetic state (see synthetic_state), in
    increasing t; one whose predicted time would leave less than ``reserve(samples so far)`` of the
    budget is skipped (so are the later ones: they cost more)."""
    done: list[dict] = []
    skipped: list[dict] = []
    for t in sorted(times):
        if done:
            last = done[-1]
            predicted = last["seconds"] * (t / last["t"]) ** NAIVE_GROWTH * repeats
            if skipped or not budget.allows(predicted, reserve(done)):
                skipped.append({"t": t, "predicted_s": predicted, "why": "budget"})
                print(f"  naive step at {t:>4} s: skipped (predicted {predicted:.0f} s; "
                      f"{budget.left():.0f} s of the budget left)", flush=True)
                continue
        row = naive_step(asr, audio, settings, t, synthetic_state(asr, settings, t - 1, words), repeats)
        row.pop("res")
        row["same_tokens_as_ours"] = None  # no ours (Session) step to compare with
        done.append(row)
    return {"naive": done, "skipped": skipped}


# --------------------------------------------------------------------------- 3. the production path
class TurnWatch:
    """The turn Sessions a LiveSession opens during a push. The public API reports events, not the work
    of a step, so this wraps the session's private turn factory: the wrapper only notes the Session the
    factory made (``opened``; emptied by the caller before each push) and changes nothing."""

    def __init__(self, live) -> None:  # noqa: ANN001
        self.opened: list = []
        start = live._start_turn

        def noting(*args: object, **kwargs: object) -> None:
            start(*args, **kwargs)
            self.opened.append(live._turn)

        live._start_turn = noting


def timed_push(asr, live, watch: TurnWatch, chunk: np.ndarray) -> tuple[dict, list]:  # noqa: ANN001
    """Push one chunk into ``live``; its wall time, and the work of the turn steps it caused (a push can
    finish one turn, whose last step decodes the tail, and open another)."""
    from qasr.bench.perf.machine import ForeignCpu
    from qasr.streaming import TurnFinal

    before = live._turn  # (private: the open turn's Session, read only)
    marks = {id(before): len(before.stats.prefill_tokens)} if before is not None else {}
    turns_before = live.turns
    watch.opened.clear()
    with ForeignCpu() as foreign:
        t0 = time.perf_counter()
        events = live.push(chunk)
        dt = time.perf_counter() - t0
    touched = ([before] if before is not None else []) + [s for s in watch.opened if s is not before]
    work = dict(steps=0, frames=0, encoder_rows=0, conv_chunks=0, prefill=0)
    last = None
    for s in touched:
        m, st = marks.get(id(s), 0), s.stats
        if len(st.prefill_tokens) > m:
            work["steps"] += len(st.prefill_tokens) - m
            work["frames"] += sum(st.frames[m:])
            work["encoder_rows"] += sum(st.encoder_tokens[m:])
            work["conv_chunks"] += sum(st.conv_chunks[m:])
            work["prefill"] += sum(st.prefill_tokens[m:])
            last = s.results[-1]
    shape = work_of(asr, last) if last is not None else dict(prompt=0, audio_tokens=0, prefix_tokens=0, generated=0)
    shape.pop("prefill", None)
    row = dict(seconds=dt, foreign_cpu=foreign.share, turn_open_before=before is not None,
               turn_open_after=live.in_turn, turn_s=live.turn_seconds, turns_started=live.turns - turns_before,
               turns_ended=[e.reason for e in events if isinstance(e, TurnFinal)], **work, **shape)
    return row, events


def live_step_cost(asr, audio: np.ndarray, settings: dict, pushes: int, budget: Budget,  # noqa: ANN001
                   partial: Path | None = None, label: str = "live", **live_settings: object) -> dict:
    """One LiveSession (``settings`` and ``live_settings``, default LiveConfig otherwise) given every 1 s
    chunk to ``pushes`` seconds, as fast as it goes; a row per push. Stops early past its budget share."""
    from qasr.streaming import LiveConfig, StreamConfig, TurnFinal

    cs = int(settings["chunk_size_sec"] * SR)
    live = asr.live(LiveConfig(StreamConfig(**settings), **live_settings))
    watch = TurnWatch(live)
    rows: list[dict] = []
    turns: list[dict] = []
    t_start, stop_at = time.perf_counter(), LIVE_SHARE * budget.left()
    cut = None
    for k in range(1, pushes + 1):
        row, events = timed_push(asr, live, watch, audio[(k - 1) * cs:k * cs])
        rows.append(dict(t=k, **row))
        turns += [dict(turn=e.turn, start=e.start, end=e.end, reason=e.reason) for e in events
                  if isinstance(e, TurnFinal)]
        if k % 60 == 0:
            last = rows[-60:]
            sec = [x["seconds"] for x in last]
            print(f"  {label} at {k // 60:>2} min: push median {np.median(sec) * 1e3:.1f} ms, max {max(sec):.3f} s, "
                  f"turn open in {np.mean([x['turn_open_after'] for x in last]):.0%} of pushes, most prefill "
                  f"{max(x['prefill'] for x in last)} tokens, {len(turns)} turns so far "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
            if partial is not None:
                partial.write_text(json.dumps({"live": rows}) + "\n")
        if time.perf_counter() - t_start > stop_at and k < pushes:
            cut = k
            print(f"  {label}: cut at {k} s of {pushes} (budget)", flush=True)
            break
    live.close()
    return {"rows": rows, "turns": turns, "cut_at_s": cut, "vad_backend": live.vad_backend,
            "config": {k: v for k, v in vars(live.config).items() if k != "stream"}}


def live_start(rows: list[dict], at: int) -> int:
    """Where a fresh LiveSession is in the state the continuous one was in at ``at`` or before: the last
    multiple of VAD_ALIGN_S seconds s <= at where the continuous session had no turn open from s to s+1
    (push s+1 began and ended outside a turn, and opened none); 0 (the stream's start) if there is none."""
    by_t = {r["t"]: r for r in rows}
    for s in range(at - at % VAD_ALIGN_S, 0, -VAD_ALIGN_S):
        r = by_t.get(s + 1)
        if r is not None and not r["turn_open_before"] and not r["turn_open_after"] and not r["turns_started"]:
            return s
    return 0


# -------------------------------------------------------------------------------- 2. real-time streams
def drive(n: int, measure: int, chunk_s: float, limit: float, push: Callable[[int, int], None]) -> dict:
    """n threads; thread i calls push(i, j) at the moment chunk j of its stream is complete (phase i/n
    of a chunk) for j < measure; latency = that moment to push's return. Stops every thread once more
    steps are over ``limit`` than 95% allows."""
    from qasr.bench.perf.machine import ForeignCpu

    total = n * measure
    allowed = total - math.ceil(0.95 * total)  # more steps over the limit than this: p95 is over it
    lat: list[list[float]] = [[] for _ in range(n)]
    over = [0]
    lock, stop = threading.Lock(), threading.Event()
    start = time.perf_counter() + 0.2

    def run(i: int) -> None:
        phase = i / n * chunk_s
        for j in range(measure):
            due = start + phase + (j + 1) * chunk_s  # the moment chunk j's audio is complete
            if stop.is_set():
                return
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            push(i, j)
            late = time.perf_counter() - due
            lat[i].append(late)
            if late > limit:
                with lock:
                    over[0] += 1
                    if over[0] > allowed:
                        stop.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    with ForeignCpu() as foreign:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    flat = np.array([x for xs in lat for x in xs])
    p = (lambda q: float(np.percentile(flat, q, method="inverted_cdf"))) if len(flat) else (lambda q: float("nan"))
    ok = not stop.is_set() and len(flat) == total and p(95) <= limit
    return {"streams": n, "steps_measured": int(len(flat)), "steps_planned": total, "stopped_early": stop.is_set(),
            "over_limit": over[0], "p50_s": p(50), "p95_s": p(95), "p99_s": p(99),
            "max_s": float(flat.max()) if len(flat) else float("nan"), "ok": bool(ok), "foreign_cpu": foreign.share}


def realtime_trial(asr, side: str, n: int, audio: np.ndarray, settings: dict, at: int, states: dict,  # noqa: ANN001
                   measure: int, limit: float, expect: dict) -> dict:
    """n streams pushing in real time from ``at`` seconds on; latencies of ``measure`` steps each."""
    cs = int(settings["chunk_size_sec"] * SR)
    streams, setup_ok = [], True
    t0 = time.perf_counter()
    for _ in range(n):
        if side == "ours":  # from the state of step at-2, two unmeasured steps (the first encodes everything)
            s = ours_at(asr, settings, audio, states[at - 2])
            for k in (at - 1, at):
                s.push(audio[(k - 1) * cs:k * cs])
                if k in expect:
                    setup_ok &= tuple(s.results[-1].generated) == expect[k]
        else:
            s = naive_at(asr, settings, audio, states[at])
        streams.append(s)
    setup_s = time.perf_counter() - t0

    def push(i: int, j: int) -> None:
        k = at + j + 1
        streams[i].push(audio[(k - 1) * cs:k * cs])

    out = drive(n, measure, settings["chunk_size_sec"], limit, push)
    if side == "ours":
        for s in streams:
            s.close()
    state = "synthetic" if states[at].get("synthetic") else "from ours (Session)"
    return dict(out, setup_s=setup_s, setup_tokens_match=bool(setup_ok), state=state)


def live_trial(asr, n: int, audio: np.ndarray, settings: dict, start: int, measure: int, limit: float,  # noqa: ANN001
               reference: list[dict]) -> dict:
    """n fresh LiveSessions pushing in real time from ``start`` seconds on. Stream 0 notes after each push
    whether a turn is open and how long it is, to compare with the step-cost run (``reference``)."""
    from qasr.streaming import LiveConfig, StreamConfig

    cs = int(settings["chunk_size_sec"] * SR)
    t0 = time.perf_counter()
    streams = [asr.live(LiveConfig(StreamConfig(**settings))) for _ in range(n)]
    setup_s = time.perf_counter() - t0
    seen: list[tuple[bool, float]] = []

    def push(i: int, j: int) -> None:
        k = start + j + 1
        streams[i].push(audio[(k - 1) * cs:k * cs])
        if i == 0:
            seen.append((streams[0].in_turn, streams[0].turn_seconds))

    out = drive(n, measure, settings["chunk_size_sec"], limit, push)
    for s in streams:
        s.close()
    by_t = {r["t"]: r for r in reference}
    same = [by_t[start + j + 1]["turn_open_after"] == open_ and abs(by_t[start + j + 1]["turn_s"] - turn_s) < 0.05
            for j, (open_, turn_s) in enumerate(seen) if start + j + 1 in by_t]
    return dict(out, setup_s=setup_s, start_s=start, turns_match_step_cost_run=bool(same) and all(same),
                pushes_compared=len(same))


def search_streams(side: str, trial: Callable[[int], dict], cap: int, budget: Budget) -> dict:
    """The most streams whose steps answer within the limit (95%): n doubles from 1, then is bisected.
    A failed trial while others used more than BUSY of the CPUs is run once more. A trial that would
    not fit in the budget (predicted from the last one's wall time) is not run: the figure found so far
    is then a lower bound (``cut_by_budget``)."""
    trials: dict[int, dict] = {}
    wall = [0.0]
    cut = [False]

    def run(n: int, again: bool = True) -> bool | None:
        if cut[0] or not budget.allows(wall[0]):
            cut[0] = True
            return None
        t0 = time.perf_counter()
        r = trial(n)
        wall[0] = time.perf_counter() - t0
        print(f"  {SIDES[side]:<36} {n:>3} streams: p50 {r['p50_s'] * 1e3:7.0f} ms  p95 {r['p95_s'] * 1e3:7.0f} ms  "
              f"{'ok' if r['ok'] else 'over'}{' (stopped early)' if r['stopped_early'] else ''}  "
              f"steps {r['steps_measured']}/{r['steps_planned']}, others' CPU {r['foreign_cpu']:.0%}", flush=True)
        if not r["ok"] and again and r["foreign_cpu"] > BUSY:  # other tenants were busy: once more
            ok = run(n, again=False)
            if ok is not None:
                trials[n]["retry_of"] = r
                return ok
        trials[n] = r
        return r["ok"]

    best, fail, n = 0, None, 1
    while n <= cap:
        ok = run(n)
        if not ok:
            fail = None if ok is None else n
            break
        best, n = n, min(2 * n, cap) if n < cap else cap + 1
    if fail is not None:
        lo, hi = best, fail
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = run(mid)
            if ok is None:
                break
            lo, hi = (mid, hi) if ok else (lo, mid)
        best = lo
    if cut[0]:
        print(f"  {SIDES[side]}: search stopped by the budget at {best} streams (a lower bound)", flush=True)
    return {"side": SIDES[side], "max_streams": best, "at_cap": best >= cap, "cut_by_budget": cut[0],
            "trials": [trials[k] for k in sorted(trials)]}


# ------------------------------------------------------------------------------------------ one model
def run_label(label: str, quantize: str) -> str:
    """A run's name in tables, plots and partial files: the model's label, and its quantize mode when one is on
    (``0.6b dims, int4``), so that no quantized figure can be read as the bf16 one."""
    return label if quantize == "none" else f"{label}, {quantize}"


def quantize_suffix(modes: list[str]) -> str:
    """The output stem's tail naming the quantized modes run, in the order given: ``_int8``, ``_int8_int4``;
    empty when only bf16 runs (``none``)."""
    return "".join(f"_{mode}" for mode in modes if mode != "none")


def run_model(label: str, model: str, dtype: str, args: dict) -> dict:
    import torch

    from qasr import ASR
    from qasr.bench.perf.machine import probe
    from qasr.streaming import LiveConfig, StreamConfig

    budget = Budget(args.get("deadline"))
    machine = probe()
    settings = dict(SETTINGS, max_new_tokens=args["max_new_tokens"])
    at, steps, live, live_only = args["at"], args["minutes"] * 60, args["live"], args["live_only"]
    live_pushes = max(steps, at + args["live_measure"]) if live else 0
    audio = speech(max(steps, at + args["measure"], live_pushes) + 2)
    quantize = args.get("quantize")
    asr = ASR.from_pretrained(model, device="cpu", dtype=dtype, quantize=None if quantize == "none" else quantize)
    warm = asr.stream(StreamConfig(**settings))
    for k in range(3):
        warm.push(audio[k * SR:(k + 1) * SR])
    warm.close()
    if live:  # and the VAD
        warm = asr.live(LiveConfig(StreamConfig(**settings)))
        for k in range(3):
            warm.push(audio[k * SR:(k + 1) * SR])
        warm.close()
    from qasr.testing.speaking import word_ids

    words = word_ids(Path(model)) if args["transcript"] in ("words", "steady") else None
    naive_times = [t for t in args["naive_at"] if t <= steps]
    out: dict = {"label": label, "model": model, "dtype": dtype, "settings": settings, "machine": machine,
                 "threads": torch.get_num_threads(), "sides": SIDES, "step_cost": {}}
    states: dict[int, dict] = {}
    expect: dict = {}
    if not live_only:
        print(f"[{label}] 1. step cost: {SIDES['ours']} every step to {args['minutes']} min, naive at "
              f"{naive_times} s", flush=True)
        run1 = step_cost(asr, audio, settings, max(steps, at + 1), naive_times, args["repeats"], {at - 1, at + 1},
                         {at - 1, at}, args.get("partial"))
        run1["ours"] = run1["ours"][:steps]  # (it ran past --minutes only to reach run 2's state)
        states = {at - 2: run1["states"][at - 1], at: run1["states"][at + 1]}  # state after step k = before k+1
        expect = run1["tokens"]
        # a session started mid-way (run 2's way) must continue exactly as the one that took every step
        check = ours_at(asr, settings, audio, states[at - 2])
        same = []
        for k in (at - 1, at):
            check.push(audio[(k - 1) * SR:k * SR])
            same.append(tuple(check.results[-1].generated) == expect[k])
        check.close()
        if args["transcript"] is not None:  # --live-only's synthetic states, checked against the real ones
            for nv in run1["naive"]:
                real = run1["naive_states"][nv["t"]]
                nv["synthetic_prompt_matches"] = (prompt_len(asr, settings, real) == prompt_len(
                    asr, settings, synthetic_state(asr, settings, real["steps"], words)))
        out["step_cost"] = {"ours": run1["ours"], "naive": run1["naive"]}
        out["mid_way_start_matches"] = all(same)
    if live:
        print(f"[{label}] 3. step cost: {SIDES['live']} every 1 s push to {live_pushes} s", flush=True)
        partial = args.get("partial")
        partial = partial.with_name(partial.name.replace(".partial", ".live.partial")) if partial else None
        out["live"] = live_step_cost(asr, audio, settings, live_pushes, budget, partial)
        out["live"]["side"] = SIDES["live"]
        bound_s = int(out["live"]["config"]["max_turn_s"]) + 2
        # a guess on the safe side: every push of the bound run as dear as twice the dearest push so far
        if budget.allows(bound_s * 2 * max(r["seconds"] for r in out["live"]["rows"])):
            print(f"[{label}] 3. bound: one turn to max_turn_s (turn detection off), {bound_s} pushes", flush=True)
            out["live_bound"] = live_step_cost(asr, audio, settings, bound_s, Budget(None), None,
                                               label="live, turn detection off", turn_detection=False)
        if live_only:
            print(f"[{label}] naive samples at {naive_times} s (synthetic state)", flush=True)

            def reserve(done: list[dict]) -> float:  # run 2's time: a naive trial of ~2 steps, ~4 live trials
                if not args["streams"] or not done:
                    return 0.0
                near = min(done, key=lambda r: abs(r["t"] - at))
                return 2 * near["seconds"] * (at / near["t"]) ** NAIVE_GROWTH + 4 * (args["live_measure"] + 2)

            got = naive_samples(asr, audio, settings, naive_times, args["repeats"], words, budget, reserve)
            out["step_cost"] = {"naive": got["naive"], "naive_skipped": got["skipped"]}
            states = {at: synthetic_state(asr, settings, at, words)}
    if args["streams"]:
        print(f"[{label}] 2. real-time streams at {at} s, 1 s steps, p95 <= {args['limit_ms']:.0f} ms", flush=True)
        limit = args["limit_ms"] / 1e3
        out["streams"] = {}
        for side in ("naive",) if live_only else ("ours", "naive"):
            out["streams"][side] = search_streams(
                side, lambda n, side=side: realtime_trial(asr, side, n, audio, settings, at, states,
                                                          args["measure"], limit, expect), args["cap"], budget)
        if live:
            start = live_start(out["live"]["rows"], at)
            print(f"  {SIDES['live']}: fresh sessions from {start} s (no turn open there), "
                  f"{args['live_measure']} pushes each", flush=True)
            out["streams"]["live"] = search_streams(
                "live", lambda n: live_trial(asr, n, audio, settings, start, args["live_measure"], limit,
                                             out["live"]["rows"]), args["cap"], budget)
            out["streams"]["live"]["start_s"] = start
    asr.close()
    return out


# ---------------------------------------------------------------------------------------------- report
def summary_rows(res: dict) -> list[dict]:
    """Per naive sample t: the naive step, ours (Session)'s step t and the median of its 10 steps to t,
    and (with --live) the LiveSession's push t, the median and the max of its pushes over the minute to t."""
    ours = res["step_cost"].get("ours")
    live = res.get("live", {}).get("rows")
    rows = []
    for nv in res["step_cost"]["naive"]:
        t = nv["t"]
        row = {"t": t, "naive_s": nv["seconds"], "naive_frames": nv["frames"], "naive_encoder": nv["encoder_rows"],
               "naive_prefill": nv["prefill"], "naive_prefix": nv["prefix_tokens"],
               "naive_state": nv.get("state"), "same": nv.get("same_tokens_as_ours"),
               "synthetic_prompt_matches": nv.get("synthetic_prompt_matches")}
        if ours and t <= len(ours):
            o = ours[t - 1]
            med = float(np.median([x["seconds"] for x in ours[max(0, t - 10):t]]))
            row.update(ours_s=o["seconds"], ours_median10_s=med, ratio=nv["seconds"] / med, ours_frames=o["frames"],
                       ours_encoder=o["encoder_rows"], ours_prefill=o["prefill"], prefix=o["prefix_tokens"])
        if live and t <= len(live):
            window = live[max(0, t - 60):t]
            sec = [x["seconds"] for x in window]
            lv = live[t - 1]
            row.update(live_s=lv["seconds"], live_median60_s=float(np.median(sec)), live_max60_s=float(max(sec)),
                       live_ratio_max=nv["seconds"] / max(sec), live_turn_open=lv["turn_open_after"],
                       live_max_prefill60=max(x["prefill"] for x in window),
                       live_max_encoder60=max(x["encoder_rows"] for x in window),
                       live_max_prefix60=max(x["prefix_tokens"] for x in window),
                       live_max_turn_s60=max(x["turn_s"] for x in window))
        rows.append(row)
    return rows


def live_minutes(rows: list[dict]) -> list[dict]:
    """The LiveSession's pushes per minute of the stream."""
    out = []
    for m in range(0, len(rows), 60):
        w = rows[m:m + 60]
        sec = np.array([x["seconds"] for x in w])
        out.append({"minute": m // 60 + 1, "pushes": len(w), "median_s": float(np.median(sec)),
                    "p95_s": float(np.percentile(sec, 95)), "max_s": float(sec.max()),
                    "turn_open_share": float(np.mean([x["turn_open_after"] for x in w])),
                    "max_prefill": max(x["prefill"] for x in w), "max_prefix": max(x["prefix_tokens"] for x in w),
                    "max_turn_s": max(x["turn_s"] for x in w),
                    "foreign_cpu": float(np.mean([x["foreign_cpu"] for x in w]))})
    return out


def ratio_text(ours: dict, naive: dict) -> str:
    """ours/naive in streams; never a number that was not measured: naive 0 gives a lower bound (ours/1)
    or nothing, a capped or budget-cut search a lower bound."""
    if not ours["trials"] or not naive["trials"]:
        return "not measured (no trial fitted in the budget)"
    o, n = ours["max_streams"], naive["max_streams"]
    lower = ours["at_cap"] or ours["cut_by_budget"]
    upper = naive["at_cap"] or naive["cut_by_budget"]  # naive's figure is a lower bound: the ratio could be less
    if n == 0 and o == 0:
        return "undefined (naive 0, ours 0: neither sustains one stream)"
    if n == 0:
        return f">= {o}{'+' if lower else ''} (naive 0, ours {o}{'+' if lower else ''}: the ratio is at least ours/1)"
    if lower and upper:
        return f"unknown (naive >= {n}, ours >= {o}: both searches stopped at the cap or the budget)"
    sign = ">= " if lower else ("<= " if upper else "")
    return f"{sign}{o / n:.1f} (naive {n}{'+' if upper else ''}, ours {o}{'+' if lower else ''})"


def print_report(results: list[dict], cpu: str) -> None:
    for res in results:
        m = res["machine"]
        print(f"\n== {res['label']} ({res['model']}, {res['dtype']}), {cpu}, {res['threads']} threads, bf16 GEMM peak "
              f"{m['peak_flops'] / 1e9:.0f} GFLOP/s, read {m['bandwidth_Bps'] / 1e9:.1f} GB/s; 1 s steps, "
              f"max_new_tokens {res['settings']['max_new_tokens']}")
        rows = summary_rows(res)
        ours = res["step_cost"].get("ours")
        if ours:
            print(f"step cost: {SIDES['ours']} (the step at t and the median of the 10 steps to t) vs "
                  f"{SIDES['naive']} (one step at t)")
            print(f"{'t':>6} {'ours s':>8} {'med10 s':>8} {'naive s':>8} {'naive/ours':>10} | {'log-mel frames':>15} "
                  f"| {'encoder rows':>13} | {'prefill tokens':>15} | {'prefix':>6} same")
            for r in rows:
                if "ours_s" in r:
                    print(f"{r['t']:>5}s {r['ours_s']:>8.3f} {r['ours_median10_s']:>8.3f} {r['naive_s']:>8.2f} "
                          f"{r['ratio']:>10.1f} | {r['ours_frames']:>5} / {r['naive_frames']:>7} "
                          f"| {r['ours_encoder']:>4} / {r['naive_encoder']:>6} "
                          f"| {r['ours_prefill']:>5} / {r['naive_prefill']:>7} | {r['prefix']:>6} {r['same']}")
            print(f"{SIDES['ours']}: {len(ours)} steps in {sum(x['seconds'] for x in ours):.0f} s; others' CPU "
                  f"share {np.mean([x['foreign_cpu'] for x in ours]):.0%} (mean over steps); a session started "
                  f"mid-way continues token for token like run 1: {res['mid_way_start_matches']}")
            synth = [r["synthetic_prompt_matches"] for r in rows if r["synthetic_prompt_matches"] is not None]
            if synth:
                print(f"synthetic naive state (--live-only's) gives the real prompt at every sample: {all(synth)}")
        skipped = res["step_cost"].get("naive_skipped")
        if skipped:
            gone = ", ".join(f"{x['t']} s (predicted {x['predicted_s']:.0f} s)" for x in skipped)
            print(f"{SIDES['naive']}: samples skipped by the budget at {gone}")
        if "live" in res:
            lv = res["live"]
            print(f"step cost: {SIDES['live']} (push t; median and max of the 60 pushes to t; the most prefill, "
                  f"prefix and turn length among them) vs {SIDES['naive']} (one step at t"
                  f"{', from a synthetic state' if not ours else ''})")
            print(f"{'t':>6} {'live s':>8} {'med60 s':>8} {'max60 s':>8} {'naive s':>8} {'naive/max':>9} "
                  f"| {'encoder rows':>13} | {'prefill tokens':>15} | {'prefix':>13} | turn s")
            for r in rows:
                if "live_s" in r:
                    print(f"{r['t']:>5}s {r['live_s']:>8.3f} {r['live_median60_s']:>8.3f} {r['live_max60_s']:>8.3f} "
                          f"{r['naive_s']:>8.2f} {r['live_ratio_max']:>9.1f} "
                          f"| {r['live_max_encoder60']:>4} / {r['naive_encoder']:>6} "
                          f"| {r['live_max_prefill60']:>5} / {r['naive_prefill']:>7} "
                          f"| {r['live_max_prefix60']:>4} / {r['naive_prefix']:>6} | {r['live_max_turn_s60']:>5.1f}")
            reasons: dict[str, int] = {}
            for t in lv["turns"]:
                reasons[t["reason"]] = reasons.get(t["reason"], 0) + 1
            allrows = lv["rows"]
            print(f"{SIDES['live']}: {len(allrows)} pushes in {sum(x['seconds'] for x in allrows):.1f} s"
                  f"{' (cut by the budget)' if lv['cut_at_s'] else ''}; VAD {lv['vad_backend']}; {len(lv['turns'])} "
                  f"turns ended ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}), longest "
                  f"{max((t['end'] - t['start'] for t in lv['turns']), default=0):.1f} s; a turn open after "
                  f"{np.mean([x['turn_open_after'] for x in allrows]):.0%} of pushes; others' CPU "
                  f"{np.mean([x['foreign_cpu'] for x in allrows]):.0%}")
            print(f"{'minute':>6} {'median s':>9} {'p95 s':>7} {'max s':>7} {'turn open':>9} {'max prefill':>11} "
                  f"{'max prefix':>10} {'longest turn s':>14}")
            for w in live_minutes(allrows):
                print(f"{w['minute']:>6} {w['median_s']:>9.4f} {w['p95_s']:>7.3f} {w['max_s']:>7.3f} "
                      f"{w['turn_open_share']:>9.0%} {w['max_prefill']:>11} {w['max_prefix']:>10} "
                      f"{w['max_turn_s']:>14.1f}")
            if "live_bound" in res:
                b = res["live_bound"]["rows"]
                top = max(b, key=lambda x: x["seconds"])
                print(f"bound (one turn to max_turn_s, turn detection off): most {top['seconds']:.3f} s per push "
                      f"(at {top['t']} s: prefill {top['prefill']}, prefix {top['prefix_tokens']} tokens), "
                      f"median of the last 10 before the cut {np.median([x['seconds'] for x in b[-12:-2]]):.3f} s")
        if "streams" in res:
            print(f"real-time streams at {res['streams'].get('at', '--at')} s (95% of updates within the limit):")
            for side, r in res["streams"].items():
                if not isinstance(r, dict) or "trials" not in r:
                    continue
                last = {t["streams"]: t for t in r["trials"]}
                best = last.get(r["max_streams"])
                worst = min((t for t in r["trials"] if not t["ok"]), key=lambda t: t["streams"], default=None)
                line = (f"  {SIDES[side]:<36} max {r['max_streams']}{'+ (cap)' if r['at_cap'] else ''}"
                        f"{'+ (budget)' if r['cut_by_budget'] else ''} streams")
                if best:
                    line += f"; at {best['streams']}: p95 {best['p95_s'] * 1e3:.0f} ms"
                if worst:
                    line += f"; at {worst['streams']}: p95 {worst['p95_s'] * 1e3:.0f} ms (over)"
                if side == "live":
                    line += (f"; fresh sessions from {r['start_s']} s, turns as in the step-cost run: "
                             f"{all(t['turns_match_step_cost_run'] for t in r['trials'])}")
                elif r["trials"]:
                    line += f"; state {r['trials'][0]['state']}"
                print(line)
            st = res["streams"]
            if "ours" in st:
                print(f"  ratio {SIDES['ours']} / naive: {ratio_text(st['ours'], st['naive'])}")
            if "live" in st:
                print(f"  ratio {SIDES['live']} / naive: {ratio_text(st['live'], st['naive'])}")


def plot(results: list[dict], title: str, at: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5))
    styles = ["-", "--", ":"]
    colors = {"ours": "tab:blue", "live": "tab:green", "naive": "tab:red"}
    for res, ls in zip(results, styles, strict=False):
        ours, naive = res["step_cost"].get("ours"), res["step_cost"]["naive"]
        lab = res["label"]
        if ours:
            t = np.array([x["t"] for x in ours]) / 60
            a.plot(t, [x["seconds"] for x in ours], ls, color=colors["ours"], lw=0.7, alpha=0.8,
                   label=f"{SIDES['ours']}, {lab}")
            b.plot(t, [x["prefill"] for x in ours], ls, color=colors["ours"], lw=0.7,
                   label=f"{SIDES['ours']} prefill, {lab}")
            b.plot(t, [x["encoder_rows"] for x in ours], ls, color="tab:cyan", lw=0.7,
                   label=f"{SIDES['ours']} encoder rows, {lab}")
        if "live" in res:
            rows = res["live"]["rows"]
            t = np.array([x["t"] for x in rows]) / 60
            a.plot(t, [x["seconds"] for x in rows], ls, color=colors["live"], lw=0.5, alpha=0.7,
                   label=f"{SIDES['live']} (every push), {lab}")
            busy = [x["prefill"] if x["prefill"] else np.nan for x in rows]  # pushes in silence prefill nothing
            b.plot(t, busy, ls, color=colors["live"], lw=0.5, label=f"{SIDES['live']} prefill, {lab}")
            b.plot(t, [x["encoder_rows"] if x["encoder_rows"] else np.nan for x in rows], ls, color="tab:olive",
                   lw=0.5, label=f"{SIDES['live']} encoder rows, {lab}")
        if "live_bound" in res:  # the most a turn costs: one that runs to max_turn_s
            # (only pushes that took a step: 1 s is 31.25 VAD frames, so now and then a push completes none)
            rows = [x for x in res["live_bound"]["rows"] if x["steps"]]
            a.plot([x["t"] / 60 for x in rows], [x["seconds"] for x in rows], ls, color="black", lw=0.8,
                   label=f"{SIDES['live']}, one turn to max_turn_s (turn detection off), {lab}")
        a.plot([x["t"] / 60 for x in naive], [x["seconds"] for x in naive], ls, marker="o", color=colors["naive"],
               label=f"{SIDES['naive']}, {lab}")
        b.plot([x["t"] / 60 for x in naive], [x["prefill"] for x in naive], ls, marker="o", color=colors["naive"],
               label=f"{SIDES['naive']} prefill, {lab}")
        b.plot([x["t"] / 60 for x in naive], [x["encoder_rows"] for x in naive], ls, marker="s", color="tab:orange",
               label=f"{SIDES['naive']} encoder rows, {lab}")
        for side, color in colors.items():
            r = res.get("streams", {}).get(side)
            if r and r["trials"]:
                tr = r["trials"]
                c.plot([x["streams"] for x in tr], [x["p95_s"] * 1e3 for x in tr], ls, marker="o", color=color,
                       label=f"{SIDES[side]}, {lab} (max {r['max_streams']})")
    a.set(yscale="log", xlabel="elapsed stream time (min)", ylabel="seconds per 1 s step (push)", title="step cost")
    b.set(yscale="log", xlabel="elapsed stream time (min)", ylabel="tokens per step (push)", title="work per step")
    if any("limit_ms" in r.get("streams", {}) for r in results):
        c.axhline(results[0]["streams"]["limit_ms"], color="gray", lw=0.8)
    c.set(xscale="log", yscale="log", xlabel="concurrent real-time streams", ylabel="update latency p95 (ms)",
          title=f"real-time streams at {at / 60:g} min")
    c.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    c.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    for ax in (a, b, c):
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", nargs="+", default=None, choices=("0.6b", "demo"),
                   help="random checkpoints at these dims (default: 0.6b demo; --quick: demo)")
    p.add_argument("--transcript", default="words", choices=("words", "empty", "steady"),
                   help="what the random checkpoints' text is (default words: it grows like speech; steady: a "
                        "fixed chain of words that a later step makes again, like a trained model's transcript; "
                        "see qasr.testing.speaking)")
    p.add_argument("--model", default=None, help="a checkpoint directory, run as it is (instead of --dims)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", nargs="+", default=["none"], choices=QUANTIZE_CHOICES,
                   help="weight quantization; several (none int8 int4) run each model once per value, one after "
                        "the other in the same run (default none); the output files end in the quantized modes "
                        "run (_int8, _int8_int4)")
    p.add_argument("--minutes", type=int, default=None, help="stream length of run 1 (default 10; --quick 2)")
    p.add_argument("--naive-at", type=int, nargs="+", default=None,
                   help="elapsed seconds of the naive samples (default 10 30 60 120 300 600)")
    p.add_argument("--repeats", type=int, default=3, help="naive steps taken at each --naive-at (median)")
    p.add_argument("--at", type=int, default=None, help="elapsed seconds where run 2 starts (default 300; --quick 60)")
    p.add_argument("--measure", type=int, default=None, help="timed steps per stream in run 2 (default 20; --quick 8)")
    p.add_argument("--live", action="store_true", help="also the production path: LiveSession (VAD turns)")
    p.add_argument("--live-only", action="store_true",
                   help="the LiveSession against the naive side, without ours (Session); implies --live")
    p.add_argument("--live-measure", type=int, default=None,
                   help="timed pushes per LiveSession in run 2 (default 45: a loop of the audio; --quick 20)")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="wall-time budget: cut or skip what would not fit (see the module docstring)")
    p.add_argument("--limit-ms", type=float, default=500.0, help="p95 update latency limit (default 500)")
    p.add_argument("--cap", type=int, default=64, help="most streams tried (default 64, the engine's max_running)")
    p.add_argument("--max-new-tokens", type=int, default=9,
                   help="per step (default 9: ~4 new tokens of speech per second + the 5 re-generated)")
    p.add_argument("--no-streams", action="store_true", help="skip run 2")
    p.add_argument("--quick", action="store_true", help="a smoke run: demo dims, 2-minute streams, minute 1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--name", default=None, help="output file stem (default streaming[_quick][_live])")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "results" / "cache")
    args = p.parse_args(argv)
    q = args.quick
    minutes = args.minutes or (2 if q else 10)
    naive = args.naive_at or ([10, 30, 60, 120] if q else [10, 30, 60, 120, 300, 600])
    at = args.at or (60 if q else 300)
    live = args.live or args.live_only
    plan = {"minutes": minutes, "naive_at": [t for t in naive if t <= minutes * 60], "at": at,
            "measure": args.measure or (8 if q else 20), "limit_ms": args.limit_ms, "cap": args.cap,
            "max_new_tokens": args.max_new_tokens, "streams": not args.no_streams, "repeats": args.repeats,
            "live": live, "live_only": args.live_only, "live_measure": args.live_measure or (20 if q else 45),
            "budget_minutes": args.budget_minutes,
            "transcript": None if args.model else args.transcript}
    if at < 3:
        p.error("--at must be at least 3")
    if args.live_only and args.model:
        p.error("--live-only needs --dims: its naive states are synthetic, exact only for the random checkpoints")
    from qasr.bench.common import in_subprocess
    from qasr.bench.perf.machine import cpu_info

    args.cache.mkdir(parents=True, exist_ok=True)
    if args.model:
        models = [(Path(args.model).name, args.model)]
    else:
        dims = args.dims or (["demo"] if q else ["0.6b", "demo"])
        models = [(f"{d} dims", str(build_checkpoint(args.cache, d, args.transcript))) for d in dims]
    runs = [(run_label(label, mode), model, mode) for label, model in models for mode in args.quantize]
    info = cpu_info()
    cpu = (f"{info['model']} ({'AMX' if info['amx_bf16'] else 'no AMX'}, "
           f"{'AVX512-BF16' if info['avx512_bf16'] else 'no AVX512-BF16'})")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or ("streaming" + ("_quick" if q else "") + ("_live" if live else "")
                                     + ("_empty" if args.transcript == "empty" and not args.model else "")
                                     + quantize_suffix(args.quantize)))
    # with_name, not with_suffix: a --name with dots ("streaming_live_0.6b") would lose its tail
    json_path, png_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".png")
    results: list[dict] = []
    t0 = time.perf_counter()
    end = time.time() + args.budget_minutes * 60 if args.budget_minutes else None
    sides = [SIDES["live"]] if args.live_only else [SIDES["ours"]] + ([SIDES["live"]] if live else [])
    title = (f"{', '.join(sides)} vs {SIDES['naive']}; 1 s steps, max_new_tokens {plan['max_new_tokens']}, "
             f"{args.threads} threads, {cpu}")
    for i, (label, model, mode) in enumerate(runs):
        partial = args.out / f"{stem.name}.{label.replace(' ', '_').replace(',', '')}.partial.json"
        deadline = None if end is None else time.time() + (end - time.time()) / (len(runs) - i)
        result = in_subprocess(run_model, args.threads, label, model, args.dtype,
                               dict(plan, partial=partial, deadline=deadline, quantize=mode))
        result["quantize"] = mode
        result["summary"] = summary_rows(result)
        if "live" in result:
            result["live"]["minutes"] = live_minutes(result["live"]["rows"])
        if "streams" in result:
            result["streams"].update(at=at, limit_ms=args.limit_ms)
            for side in ("ours", "live"):
                if side in result["streams"]:
                    result["streams"][f"ratio_{side}_to_naive"] = ratio_text(result["streams"][side],
                                                                             result["streams"]["naive"])
        results.append(result)
        meta = {"cpu": cpu, "cpu_flags": info, "machine": platform.platform(), "python": platform.python_version(),
                "threads": args.threads, "plan": plan, "sides": SIDES,
                "audio": str(AUDIO.relative_to(ROOT)) + " looped",
                "transcript": "as the checkpoint generates" if args.model else args.transcript,
                "wall_s": time.perf_counter() - t0, "load_avg_end": os.getloadavg()}
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        plot(results, title, plan["at"], png_path)  # (rewritten after each model)
        partial.unlink(missing_ok=True)
        partial.with_name(partial.name.replace(".partial", ".live.partial")).unlink(missing_ok=True)
    print_report(results, cpu)
    print(f"\nwrote {json_path} and {png_path} "
          f"({(time.perf_counter() - t0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
