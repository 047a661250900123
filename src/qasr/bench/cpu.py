"""CPU mode of the throughput benchmark (``qasr bench``): qasr's engine against transformers' generate.

Both sides run one random checkpoint with the real 0.6B dimensions on the same seeded clips with 4 forced
tokens per audio second, so they do equal work; efficiency is reported against the machine's peaks
(``perf/``). ``--quantize <mode>`` adds a qasr side with ``quantize=<mode>``. The last line is
``speedup=<x> rtfx=<y> efficiency=<z>`` (and ``<mode>_over_bf16=<x>``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.bench.common import (
    CONTENDED,
    SR,
    TOKENS_PER_SECOND,
    PeakRss,
    ReferenceGenerate,
    build_checkpoint,
    clip_lengths,
    closed_loop,
    in_subprocess,
    make_clip,
    save_report,
)
from qasr.bench.perf.flops import Utterance, workload_flops
from qasr.bench.perf.machine import ForeignCpu, probe
from qasr.bench.perf.phases import ForwardLog, Storage, efficiency_report, timing_delta
from qasr.bench.perf.report import draw_roofline, machine_line, phase_table
from qasr.engine.config import QUANTIZE_MODES
from qasr.model.config import ModelConfig


@dataclass(frozen=True)
class Workload:
    clips_s: tuple[float, ...]  # throughput clips (2-120 s)
    ttft_levels: tuple[tuple[int, int], ...]  # (concurrency, requests)
    ttft_clip_range: tuple[float, float]


QUICK = Workload(clips_s=(), ttft_levels=((1, 3), (4, 8), (16, 16), (64, 64)), ttft_clip_range=(1.0, 4.0))
FULL = Workload(clips_s=(), ttft_levels=((1, 8), (4, 16), (16, 48), (64, 128)), ttft_clip_range=(2.0, 20.0))


# --- qasr
def run_qasr(ckpt_dir: Path, clips: list[np.ndarray], wl: Workload, kv_gib: float, seed: int,
             quantize: str | None = None, kv_cache_dtype: str = "auto", ttft: bool = True) -> dict:
    """One qasr side: the clips at once through one engine (wall time, phases, what each forward
    carried), then TTFT by arrival concurrency unless ``ttft`` is False."""
    from qasr.engine.engine import Engine, EngineConfig, RequestSpec
    from qasr.model.checkpoint import load_checkpoint
    from qasr.model.config import audio_token_count
    from qasr.model.prompt import build_prompt

    ck = load_checkpoint(ckpt_dir, device="cpu", dtype="bfloat16")
    engine = Engine(ck, EngineConfig(kv_cache_bytes=int(kv_gib * 2**30), quantize=quantize,
                                     kv_cache_dtype=kv_cache_dtype))
    hop = ck.features.hop_length
    utterances: list[Utterance] = []

    def submit(wave: np.ndarray):
        frames = len(wave) // hop
        prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(frames))
        new_tokens = round(TOKENS_PER_SECOND * len(wave) / SR)
        utterances.append(Utterance(frames, len(prompt), new_tokens))
        return engine.submit(RequestSpec(prompt, new_tokens, waveform=wave, ignore_eos=True))

    # warm-up: builds the native kernel and touches the code paths
    submit(make_clip(3.0, 999)).result()
    utterances.clear()
    steps0, timings0 = engine.steps, dict(engine.timings)
    forwards = ForwardLog()
    forwards.attach(engine.core.runner)  # counts what each forward carries, to split the mixed forwards' time
    with PeakRss() as rss, ForeignCpu() as others:
        t0 = time.perf_counter()
        # longest first, as ASR.transcribe does
        futures = [submit(w) for w in sorted(clips, key=len, reverse=True)]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    phases = timing_delta(engine.timings, timings0)  # the measured window only, not the warm-up
    measured = list(utterances)
    tokens = sum(len(r.token_ids) for r in results)
    audio_s = sum(len(w) for w in clips) / SR
    out = dict(wall_s=wall, audio_s=audio_s, rtfx=audio_s / wall, tokens=tokens, steps=engine.steps - steps0,
               peak_rss_gib=rss.peak / 2**30, kv_cache_gib=engine.core.pool.nbytes / 2**30,
               phases=phases, forwards=asdict(forwards), utterances=[asdict(u) for u in measured],
               foreign_cpu_s=others.seconds, foreign_cpu_share=others.share, kernels=engine.prepared.description,
               kv_cache_dtype=kv_cache_dtype)
    if ttft:
        out["ttft"] = measure_ttft(submit, wl, seed)
    engine.close()
    return out


DECODE_B1_TOKENS = 65  # tokens per batch-1 run: 64 decode steps after the one prefill makes
DECODE_B1_ROUNDS = 5


def measure_decode_batch1(ckpt_dir: Path, quantizes: tuple[str | None, ...], rounds: int = DECODE_B1_ROUNDS,
                          kv_cache_dtypes: tuple[str, ...] | None = None) -> dict:
    """Time per generated token of one request alone, for each setting in ``quantizes`` (None: bf16),
    the settings' runs interleaved round by round; from the first token to the last (no encoder or
    prefill), the median over ``rounds``. ``kv_cache_dtypes``: each setting's KV cache dtype."""
    from qasr.engine.engine import Engine, EngineConfig, RequestSpec
    from qasr.model.checkpoint import load_checkpoint
    from qasr.model.config import audio_token_count
    from qasr.model.prompt import build_prompt

    ck = load_checkpoint(ckpt_dir, device="cpu", dtype="bfloat16")
    wave = make_clip(5.0, 4242)
    prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // ck.features.hop_length))

    def one_run(engine: Engine) -> float:
        stamps: list[float] = []

        def stamp(token: int | None) -> None:
            if token is not None:
                stamps.append(time.perf_counter())

        engine.submit(RequestSpec(prompt, DECODE_B1_TOKENS, waveform=wave, ignore_eos=True), on_token=stamp).result()
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    # one engine at a time: two live engines throttle libgomp (docs/log: bench-decode-one-engine)
    runs: list[list[float]] = [[] for _ in quantizes]
    kvs = kv_cache_dtypes or ("auto",) * len(quantizes)
    for _ in range(rounds):
        for k, q in enumerate(quantizes):
            with Engine(ck, EngineConfig(kv_cache_bytes=2**28, quantize=q, kv_cache_dtype=kvs[k])) as engine:
                one_run(engine)  # warm-up: kernels built, shapes touched
                runs[k].append(one_run(engine))
    out = {}
    for q, kv, r in zip(quantizes, kvs, runs, strict=True):
        name = q or "none"
        out[name] = dict(ms_per_token=1e3 * float(np.median(r)), runs_ms=[1e3 * x for x in r], tokens=DECODE_B1_TOKENS,
                         kv_cache_dtype=kv)
        print(f"  qasr{'' if q is None else ' ' + q}{'' if kv == 'auto' else ' kv ' + kv} decode at batch 1: "
              f"{out[name]['ms_per_token']:.1f} ms/token "
              f"(median of {rounds}, interleaved)", flush=True)
    return out


def measure_ttft(submit, wl: Workload, seed: int) -> dict:  # noqa: ANN001 - the engine's submit
    """Closed loop: TTFT p50 / p95 per concurrency level."""
    rng = np.random.default_rng(seed + 7)
    report = {}
    for conc, n_req in wl.ttft_levels:
        lengths = [float(rng.uniform(*wl.ttft_clip_range)) for _ in range(n_req)]
        waves = [make_clip(s, 1000 + k) for k, s in enumerate(lengths)]
        level = closed_loop(lambda k, waves=waves: submit(waves[k]), lengths, conc)
        if level["error_count"]:
            raise RuntimeError(f"TTFT level {conc}: {level['errors'][0]}")
        report[str(conc)] = dict(requests=n_req, p50_s=level["ttft_p50_s"], p95_s=level["ttft_p95_s"],
                                 rtfx=level["rtfx"])
        print(f"  qasr TTFT conc {conc:3d}: p50 {report[str(conc)]['p50_s']*1e3:7.0f} ms  "
              f"p95 {report[str(conc)]['p95_s']*1e3:7.0f} ms", flush=True)
    return report


# --- reference
def run_reference(ckpt_dir: Path, clips: list[np.ndarray], batch: int = 8) -> dict:
    generate = ReferenceGenerate(ckpt_dir)
    order = sorted(range(len(clips)), key=lambda i: len(clips[i]))

    def run_batch(idx: list[int]) -> int:
        return generate([clips[i] for i in idx])

    run_batch(order[:1])  # warm-up
    with PeakRss() as rss, ForeignCpu() as others:
        t0 = time.perf_counter()
        tokens = sum(run_batch(order[i:i + batch]) for i in range(0, len(order), batch))
        wall = time.perf_counter() - t0
    audio_s = sum(len(w) for w in clips) / SR
    return dict(wall_s=wall, audio_s=audio_s, rtfx=audio_s / wall, tokens=tokens, peak_rss_gib=rss.peak / 2**30,
                batch=batch, foreign_cpu_s=others.seconds, foreign_cpu_share=others.share)


# --- report
def quantized_mode(report: dict) -> str | None:
    """The quantize mode whose side a report carries (its figures under the mode's name), or None."""
    return next((mode for mode in QUANTIZE_MODES if mode in report), None)


def decode_b1_ratio(decode_b1: dict, mode: str) -> dict:
    """The mode's batch-1 time per token over bf16's: the median of each round's ratio, as the drift
    cancels within a round (docs/log: bench-decode-rounds), with the ratio of the medians beside it."""
    ours, bf16 = decode_b1[mode], decode_b1["none"]
    of_medians = ours["ms_per_token"] / bf16["ms_per_token"]
    runs, base = ours.get("runs_ms"), bf16.get("runs_ms")
    if not runs or not base or len(runs) != len(base):
        return {"decode_b1_over_bf16": of_medians}
    by_round = [q / b for q, b in zip(runs, base, strict=True)]
    return {"decode_b1_over_bf16": float(np.median(by_round)), "decode_b1_over_bf16_by_round": by_round,
            "decode_b1_over_bf16_of_medians": of_medians}


def add_quantized_side(report: dict, mode: str, side: dict, side_efficiency: dict) -> None:
    """Put a quantized run into a bf16 report: its run as ``qasr_<mode>``, its figures as ``<mode>``;
    the bf16 figures stay where they are."""
    report[f"qasr_{mode}"] = side
    report[mode] = {"speedup": side["rtfx"] / report["reference"]["rtfx"],
                    f"{mode}_over_bf16": side["rtfx"] / report["qasr"]["rtfx"], "efficiency": side_efficiency,
                    **decode_b1_ratio(report["decode_b1"], mode)}
    report["title"] += f"; and qasr {mode}"  # its kernels are in qasr_<mode>.kernels (a long line for a title)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = ["transformers (batch 8)", "qasr"]
    vals = [report["reference"]["rtfx"], report["qasr"]["rtfx"]]
    mode = quantized_mode(report)
    if mode is not None:
        names.append(f"qasr {mode}")
        vals.append(report[f"qasr_{mode}"]["rtfx"])
    a.bar(names, vals, color=["#999999", "#2b7bba", "#e08a2b"][:len(vals)])
    a.set_ylabel("audio seconds per wall second (RTFx)")
    a.set_title(f"throughput, qasr bf16 x{report['speedup']:.2f}" + (
        f", {mode} x{report[mode]['speedup']:.2f}" if mode is not None else ""))
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    conc = list(report["qasr"]["ttft"])
    b.plot(conc, [report["qasr"]["ttft"][c]["p50_s"] * 1e3 for c in conc], "o-", label="p50")
    b.plot(conc, [report["qasr"]["ttft"][c]["p95_s"] * 1e3 for c in conc], "s--", label="p95")
    b.set_xlabel("arrival concurrency")
    b.set_ylabel("qasr time to first token (ms)")
    b.set_yscale("log")
    b.legend()
    b.set_title("qasr TTFT (closed loop)")
    draw_roofline(c, report["efficiency"])
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    """The CPU mode: both sides on the CPU, each in its own process; the machine probed first."""
    wl = QUICK if args.quick else FULL
    lengths = clip_lengths(args.clips or (16 if args.quick else 48), args.seed)
    clips = [make_clip(s, args.seed * 1000 + k) for k, s in enumerate(lengths)]
    threads = torch.get_num_threads()
    # the machine first, in its own process like both sides
    machine = in_subprocess(probe, threads)
    print(machine_line(machine), flush=True)
    ckpt = build_checkpoint(args.cache)
    print(f"workload: {len(clips)} clips, {sum(lengths):.0f} s of audio (2-120 s), "
          f"{TOKENS_PER_SECOND} forced tokens per audio second, bf16, {threads} threads", flush=True)
    t0 = time.perf_counter()
    # each side in a fresh process, so peak RSS and warm caches are its own
    requested = getattr(args, "quantize", "none")
    mode = None if requested == "none" else requested  # the quantized side's name (int8, int4); None: bf16 alone
    # --kv-cache-dtype: the quantized side's KV cache, else qasr's
    kv = getattr(args, "kv_cache_dtype", "auto")
    ours = in_subprocess(run_qasr, threads, ckpt, clips, wl, args.kv_gib, args.seed, None,
                         kv if mode is None else "auto")
    print(f"  qasr{kv_label(ours)}: {ours['wall_s']:.1f} s, RTFx {ours['rtfx']:.1f}, phases "
          + ", ".join(f"{k} {v:.1f}" for k, v in ours["phases"].items()), flush=True)
    quant = None
    if mode is not None:
        quant = in_subprocess(run_qasr, threads, ckpt, clips, wl, args.kv_gib, args.seed, mode, kv)
        print(f"  qasr {mode}{kv_label(quant)} ({quant['kernels']}): {quant['wall_s']:.1f} s, RTFx "
              f"{quant['rtfx']:.1f}, phases " + ", ".join(f"{k} {v:.1f}" for k, v in quant["phases"].items()),
              flush=True)
    rounds = [side_pair(ours, quant)] if quant is not None else []
    # with a quantized side, the two qasr sides again (no TTFT): the median of the pairs' ratios is reported
    n_rounds = getattr(args, "rounds", 1) if quant is not None else 0
    for k in range(2, n_rounds + 1):
        pair = side_pair(in_subprocess(run_qasr, threads, ckpt, clips, wl, args.kv_gib, args.seed, None, "auto",
                                       False),
                         in_subprocess(run_qasr, threads, ckpt, clips, wl, args.kv_gib, args.seed, mode, kv, False))
        rounds.append(pair)
        print(f"  round {k}: qasr {pair['bf16_wall_s']:.1f} s, qasr {mode} {pair['quantized_wall_s']:.1f} s, "
              f"{mode}_over_bf16 {pair['ratio']:.2f}", flush=True)
    decode_b1 = in_subprocess(measure_decode_batch1, threads, ckpt, (None,) if mode is None else (None, mode),
                              DECODE_B1_ROUNDS, (kv,) if mode is None else ("auto", kv))
    ref = in_subprocess(run_reference, threads, ckpt, clips)
    print(f"  transformers: {ref['wall_s']:.1f} s, RTFx {ref['rtfx']:.1f}", flush=True)
    speedup = ours["rtfx"] / ref["rtfx"]
    cfg = ModelConfig.from_file(ckpt / "config.json")

    def efficiency(side: dict, quantize: str | None) -> dict:
        utterances = [Utterance(**u) for u in side["utterances"]]
        storage = Storage.of(2, quantize, side.get("kv_cache_dtype", "auto"), cfg.decoder.head_dim)  # bf16 model
        return efficiency_report(cfg, utterances, workload_flops(cfg, utterances), side["audio_s"], side["wall_s"],
                                 side["phases"], ForwardLog(**side["forwards"]), machine,
                                 reference_wall_s=ref["wall_s"], storage=storage)

    eff = efficiency(ours, None)
    cpu = machine["cpu"]
    report = dict(title=f"Qwen3-ASR-0.6B dims (random weights), {len(clips)} clips / {sum(lengths):.0f} s, "
                  f"bf16, {threads} CPU threads, torch {torch.__version__}; {cpu['model']}, "
                  f"peak {machine['peak_flops'] / 1e9:.0f} GFLOP/s, {machine['bandwidth_Bps'] / 1e9:.1f} GB/s",
                  workload=dict(clips_s=lengths, tokens_per_second=TOKENS_PER_SECOND), machine=machine,
                  qasr=ours, reference=ref, speedup=speedup, efficiency=eff, decode_b1=decode_b1,
                  total_wall_s=time.perf_counter() - t0)
    if quant is not None:
        add_quantized_side(report, mode, quant, efficiency(quant, mode))
        if len(rounds) > 1:
            add_rounds(report, mode, rounds)
    stem = (("throughput_quick" if args.quick else "throughput") + ("" if mode is None else f"_{mode}")
            + ("" if kv == "auto" else f"_kv{kv}"))
    save_report(report, args.out, stem, plot, machine)
    print("| engine | wall s | audio s | RTFx | tokens | peak RSS GiB | efficiency | others' CPU |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [("transformers generate, batch 8", ref, eff["reference_overall"]),
            (f"qasr engine{kv_label(ours)}", ours, eff["overall"])]
    if quant is not None:
        rows.append((f"qasr engine, {mode}{kv_label(quant)}", quant, report[mode]["efficiency"]["overall"]))
    for name, r, e in rows:
        print(f"| {name} | {r['wall_s']:.1f} | {r['audio_s']:.0f} | {r['rtfx']:.1f} | {r['tokens']} | "
              f"{r['peak_rss_gib']:.2f} | {100 * e:.1f}% | {100 * r['foreign_cpu_share']:.0f}% |")
    for name, r, _ in rows:
        if r["foreign_cpu_share"] > CONTENDED:
            print(f"WARNING: other processes used {100 * r['foreign_cpu_share']:.0f}% of the CPUs during the "
                  f"{name} side: its figures are not representative of this machine")
    print()
    print(phase_table(eff))
    if quant is not None:
        print(f"\n{mode}:")
        print(phase_table(report[mode]["efficiency"]))
    if len(rounds) > 1:
        print(f"\n{mode}_over_bf16 by round: " + ", ".join(f"{r['ratio']:.2f}" for r in rounds)
              + f"; median {report[mode][f'{mode}_over_bf16']:.2f} (the last line's)")
    for name, side in (("qasr", ours), (f"qasr {mode}", quant)):
        if side is not None:
            print(f"\n{name} TTFT by arrival concurrency: " + ", ".join(
                f"c={c}: p50 {v['p50_s']*1e3:.0f} ms / p95 {v['p95_s']*1e3:.0f} ms" for c, v in side["ttft"].items()))
    ratio = ""
    if quant is not None:
        figures = report[mode]
        ratio = f" ({mode} / bf16 = {figures['decode_b1_over_bf16']:.2f}"
        if "decode_b1_over_bf16_by_round" in figures:
            rounds_text = ", ".join(f"{r:.2f}" for r in figures["decode_b1_over_bf16_by_round"])
            ratio += (f", the median of the rounds' {rounds_text}; the medians' ratio "
                      f"{figures['decode_b1_over_bf16_of_medians']:.2f}")
        ratio += ")"
    print("\ndecode at batch 1 (one request alone, 5 s clip, sides interleaved in one process): " + ", ".join(
        f"qasr{'' if q == 'none' else ' ' + q} {v['ms_per_token']:.1f} ms/token" for q, v in decode_b1.items()) + ratio)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    if quant is not None:
        print("bf16: " + summary_line({k: v for k, v in report.items() if k != mode}))
    print(summary_line(report))
    return 0


def side_pair(bf16: dict, quantized: dict) -> dict:
    """One round of --rounds: the two qasr sides' wall seconds and the quantized one's RTFx over bf16's."""
    return dict(bf16_wall_s=bf16["wall_s"], quantized_wall_s=quantized["wall_s"],
                ratio=quantized["rtfx"] / bf16["rtfx"])


def add_rounds(report: dict, mode: str, rounds: list[dict]) -> None:
    """With --rounds N > 1: each round's pair under ``rounds``, ``<mode>_over_bf16`` their median (the
    first round's as ``<mode>_over_bf16_first``)."""
    key = f"{mode}_over_bf16"
    report["rounds"] = rounds
    report[mode][f"{key}_first"] = report[mode][key]
    report[mode][key] = float(np.median([r["ratio"] for r in rounds]))


def kv_label(side: dict) -> str:
    """How a side's KV cache is named in the printed rows: nothing for the model's dtype."""
    kv = side.get("kv_cache_dtype", "auto")
    return "" if kv == "auto" else f" (kv {kv})"


def summary_line(report: dict) -> str:
    """The CPU mode's last line, the one scripts read."""
    mode = quantized_mode(report)
    if mode is not None:
        side = report[mode]
        return (f"speedup={side['speedup']:.2f} rtfx={report[f'qasr_{mode}']['rtfx']:.1f} "
                f"efficiency={side['efficiency']['overall']:.3f} {mode}_over_bf16={side[f'{mode}_over_bf16']:.2f}")
    return (f"speedup={report['speedup']:.2f} rtfx={report['qasr']['rtfx']:.1f} "
            f"efficiency={report['efficiency']['overall']:.3f}")

