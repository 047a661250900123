"""Aligner mode of the throughput benchmark (``qasr bench --aligner``): a random 0.6B forced aligner,
seeded clips and transcripts, qasr's ``Aligner.submit_pieces`` against transformers' token classification.
The last line is ``aligner_speedup=<x> aligner_rtfx=<y>``; the word times' agreement is reported.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from qasr.bench.common import CONTENDED, SR, PeakRss, clip_lengths, in_subprocess, make_clip, save_report
from qasr.bench.perf.machine import ForeignCpu, probe
from qasr.bench.perf.report import machine_line

WORDS_PER_SECOND = 2.5  # a brisk speaker: what a transcript of real speech carries
MIN_S, MAX_S = 2.0, 60.0  # the aligner's pieces: the official pipeline aligns at most 180 s at a time
CLASSIFY_NUM = 5000  # the release's timestamp classes, TIME_STEP_S apart
LANGUAGE = "English"
TIME_STEP_S = 0.08  # one timestamp class

# common English words, each one token for the checkpoint's tokenizer, as for the real one
WORDS: tuple[str, ...] = tuple("""
the of and to in is that for it with as was on be at by this have from or one had not but what all were
when we there can an your which their said if do will each about how up out them then she many some so
these would other into has more her two like him see time could no make than first been its who now
people my made over did down only way find use may water long little very after words called just where
most know get through back much go good new write our me man too any day same right look think also around
another came come work three word must because does part even place well such here take why things help
put years different away again off went old number great tell men say small every found still between
name should home big give air line set own under read last never us left end along while might next sound
below saw something thought both few those always looked show large often together asked house world
going want school important until form food keep children feet land side without boy once animals life
enough took sometimes four head above kind began almost live page got earth need far hand high year
mother light parts country father let night following picture being study second eyes soon times story
boys since white days paper hard near sentence better best across during today others however sure means
knew try told young miles sun ways thing whole hear example heard several change answer room sea against
top turned learn point city play toward five using himself usually money seen car morning given friends
""".split())

# the chat template transformers' processor needs and the random tokenizer lacks: audio, then each
# word and its two timestamp slots
CHAT_TEMPLATE = (
    "{%- for m in messages %}{%- for c in m['content'] %}{%- if c['type'] == 'audio' %}"
    "<|audio_start|><|audio_pad|><|audio_end|>{%- else %}{{ c['text'] }}<timestamp><timestamp>{%- endif %}"
    "{%- endfor %}{%- endfor %}"
)

WordTimes = list[list[tuple[float, float]]]  # per clip, per word: (start, end) seconds


def transcript(seconds: float, seed: int) -> str:
    """A seeded transcript of about WORDS_PER_SECOND words per second (at least one word)."""
    rng = np.random.default_rng(seed)
    n = max(1, round(WORDS_PER_SECOND * seconds))
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def workload(n: int, seed: int) -> tuple[list[float], list[np.ndarray], list[str]]:
    """n clip lengths (2-60 s, log-uniform), their noise clips and their transcripts, all seeded."""
    lengths = clip_lengths(n, seed, MIN_S, MAX_S)
    clips = [make_clip(s, seed * 1000 + k) for k, s in enumerate(lengths)]
    texts = [transcript(s, seed * 1000 + 500 + k) for k, s in enumerate(lengths)]
    return lengths, clips, texts


def build_aligner_checkpoint(cache_dir: Path, dims: dict[str, int] | None = None,
                             dtype: torch.dtype = torch.bfloat16) -> Path:
    """The random aligner, built once per cache dir (``dims`` default to the real 0.6B ones)."""
    from qasr.testing import QWEN3_ASR_0_6B_DIMS, make_tiny_aligner_checkpoint

    real = dims is None
    path = cache_dir / ("qwen3-forcedaligner-0.6b-dims-random-hf" if real else "aligner-random-hf")
    ready = path / "bench-ready"  # written last: a build cut short is redone, not reused half-made
    if not ready.exists():
        print(f"building a random aligner checkpoint in {path} ...", flush=True)
        # each word on its own line, so the BPE learner makes every bare word one token
        make_tiny_aligner_checkpoint(path, layout="hf", seed=0, dtype=dtype, std=0.02, classify_num=CLASSIFY_NUM,
                                     extra_text="\n" + "\n".join(WORDS) + "\n", vocab_budget=2000,
                                     **(QWEN3_ASR_0_6B_DIMS if real else dims))
        decorrelate_head(path, dtype)
        ready.write_text("random weights, decorrelated head\n")
    return path


def decorrelate_head(path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Give the random classifier varied answers, so the two sides' word times are worth comparing:
    remove the direction every slot's hidden state shares from the classifier's rows (as the aligner
    parity test does), or one class wins everywhere. One forward, once per cached checkpoint."""
    from safetensors.torch import load_file, save_file

    from qasr.align.aligner import Aligner
    from qasr.audio.features import LogMel
    from qasr.engine.engine import EngineConfig
    from qasr.engine.kv_cache import single_prefill

    # its engine is never used: the smallest KV pool (256 tokens) instead of the default gibibytes
    with Aligner.from_pretrained(path, device="cpu", dtype=dtype, engine_config=EngineConfig(kv_cache_bytes=1)) \
            as aligner:
        ck = aligner.checkpoint
        hidden = []
        for k, seconds in enumerate((3.0, 10.0)):
            wave, _, prompt = aligner._prepare(make_clip(seconds, 990 + k), transcript(seconds, 990 + k), LANGUAGE)
            n = len(prompt.ids)
            with torch.inference_mode():
                audio = ck.model.encode_audio([LogMel(ck.features)(wave)])[0]
                x = ck.model.embed(torch.tensor(prompt.ids), audio)
                h = ck.model.model(x, torch.arange(n), *single_prefill(ck.config.decoder, n, ck.device, ck.dtype))
            hidden.append(h[prompt.slots].float())
    u = torch.cat(hidden).mean(0)
    u = u / u.norm()
    file = path / "model.safetensors"
    state = load_file(str(file))
    w = state["score.weight"]
    state["score.weight"] = (w.float() - (w.float() @ u)[:, None] * u[None, :]).to(w.dtype).contiguous()
    save_file(state, str(file), metadata={"format": "pt"})


def _times(words: list) -> list[tuple[float, float]]:
    return [(float(w[0]), float(w[1])) for w in words]


# --- qasr
def run_qasr_aligner(ckpt_dir: Path, clips: list[np.ndarray], texts: list[str], kv_gib: float,
                     dtype: str = "bfloat16") -> dict:
    from qasr.align.aligner import Aligner
    from qasr.engine.engine import EngineConfig

    aligner = Aligner.from_pretrained(ckpt_dir, device="cpu", dtype=dtype,
                                      engine_config=EngineConfig(kv_cache_bytes=int(kv_gib * 2**30)))
    # warm-up: builds the native kernels and touches the code paths
    aligner.align_pieces([make_clip(3.0, 999)], [transcript(3.0, 999)], LANGUAGE)
    # longest first, as ASR.transcribe does
    order = sorted(range(len(clips)), key=lambda i: len(clips[i]), reverse=True)
    with PeakRss() as rss, ForeignCpu() as others:
        t0 = time.perf_counter()
        futures = aligner.submit_pieces([clips[i] for i in order], [texts[i] for i in order], LANGUAGE)
        found = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    words: WordTimes = [[] for _ in clips]
    for i, ws in zip(order, found, strict=True):
        words[i] = _times([(w.start, w.end) for w in ws])
    aligner.close()
    audio_s = sum(len(w) for w in clips) / SR
    return dict(wall_s=wall, audio_s=audio_s, rtfx=audio_s / wall, words=words, peak_rss_gib=rss.peak / 2**30,
                foreign_cpu_s=others.seconds, foreign_cpu_share=others.share)


# --- reference
def run_reference_aligner(ckpt_dir: Path, clips: list[np.ndarray], texts: list[str], batch: int = 8,
                          dtype: str = "bfloat16") -> dict:
    import transformers

    torch_dtype = getattr(torch, dtype)
    model = transformers.Qwen3ASRForTokenClassification.from_pretrained(ckpt_dir, dtype=torch_dtype).eval()
    processor = transformers.Qwen3ASRProcessor(feature_extractor=transformers.Qwen3ASRFeatureExtractor(),
                                               tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt_dir),
                                               chat_template=CHAT_TEMPLATE)
    ts_id = model.config.timestamp_token_id
    order = sorted(range(len(clips)), key=lambda i: len(clips[i]))

    def run_batch(idx: list[int]) -> list[list[dict]]:
        # the processor pads the prompts on the left and returns their attention mask
        inputs, word_lists = processor.prepare_forced_aligner_inputs([clips[i] for i in idx],
                                                                     [texts[i] for i in idx], language=LANGUAGE)
        with torch.inference_mode():
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                           input_features=inputs["input_features"].to(torch_dtype),
                           input_features_mask=inputs["input_features_mask"]).logits
        return processor.decode_forced_alignment(logits, inputs["input_ids"], word_lists, ts_id)

    run_batch(order[:1])  # warm-up
    words: WordTimes = [[] for _ in clips]
    with PeakRss() as rss, ForeignCpu() as others:
        t0 = time.perf_counter()
        for b in range(0, len(order), batch):
            idx = order[b:b + batch]
            for i, ws in zip(idx, run_batch(idx), strict=True):
                words[i] = _times([(w["start_time"], w["end_time"]) for w in ws])
        wall = time.perf_counter() - t0
    audio_s = sum(len(w) for w in clips) / SR
    return dict(wall_s=wall, audio_s=audio_s, rtfx=audio_s / wall, words=words, peak_rss_gib=rss.peak / 2**30,
                batch=batch, foreign_cpu_s=others.seconds, foreign_cpu_share=others.share)


# --- report
def agreement(ours: WordTimes, ref: WordTimes) -> dict:
    """How often both sides gave a word the same times: exactly, and within one class.
    ``distinct_starts`` says whether that means anything (a random head can agree trivially)."""
    words = exact = close = 0
    starts: set[float] = set()
    for a, b in zip(ours, ref, strict=True):
        words += max(len(a), len(b))
        if len(a) != len(b):  # different word lists: count the whole clip as disagreeing
            continue
        for (s1, e1), (s2, e2) in zip(a, b, strict=True):
            starts.add(s1)
            exact += (s1, e1) == (s2, e2)
            close += abs(s1 - s2) <= TIME_STEP_S + 1e-6 and abs(e1 - e2) <= TIME_STEP_S + 1e-6
    return dict(clips=len(ours), words=words, exact=exact / max(words, 1), within_80ms=close / max(words, 1),
                distinct_starts=len(starts))


def plot(report: dict, path: Path, scatter_clips: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    vals = [report["reference"]["rtfx"], report["qasr"]["rtfx"]]
    a.bar(["transformers (batch 8)", "qasr"], vals, color=["#999999", "#2b7bba"])
    a.set_ylabel("audio seconds aligned per wall second")
    a.set_title(f"forced alignment, speedup x{report['speedup']:.2f}")
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    # word start times of the first clips, one side against the other: points off the diagonal disagree
    for k in range(min(scatter_clips, len(report["qasr"]["words"]))):
        ours, ref = report["qasr"]["words"][k], report["reference"]["words"][k]
        if len(ours) == len(ref):
            b.plot([r[0] for r in ref], [o[0] for o in ours], ".", ms=4, label=f"clip {k}")
    top = max([1.0] + [w[0] for ws in report["qasr"]["words"][:scatter_clips] for w in ws])
    b.plot([0, top], [0, top], "k-", lw=0.5)
    b.set_xlabel("transformers word start (s)")
    b.set_ylabel("qasr word start (s)")
    ag = report["agreement"]
    b.set_title(f"word times: {100 * ag['exact']:.1f}% equal, {100 * ag['within_80ms']:.1f}% within 80 ms")
    b.legend(fontsize=7)
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_line(report: dict) -> str:
    """The aligner mode's last line, the one scripts read."""
    return f"aligner_speedup={report['speedup']:.2f} aligner_rtfx={report['qasr']['rtfx']:.1f}"


def run(args: argparse.Namespace) -> int:
    """Run the aligner mode with ``qasr bench``'s parsed arguments (its thread count already set)."""
    n = args.clips or (16 if args.quick else 48)
    lengths, clips, texts = workload(n, args.seed)
    threads = torch.get_num_threads()
    machine = in_subprocess(probe, threads)  # in its own process like both sides
    print(machine_line(machine), flush=True)
    ckpt = build_aligner_checkpoint(args.cache)
    n_words = sum(len(t.split()) for t in texts)
    print(f"workload: {n} clips, {sum(lengths):.0f} s of audio ({MIN_S:g}-{MAX_S:g} s), {n_words} words "
          f"({WORDS_PER_SECOND:g} per second), bf16, {threads} threads", flush=True)
    t0 = time.perf_counter()
    ours = in_subprocess(run_qasr_aligner, threads, ckpt, clips, texts, args.kv_gib)
    print(f"  qasr: {ours['wall_s']:.1f} s, {ours['rtfx']:.1f} audio-s per s", flush=True)
    ref = in_subprocess(run_reference_aligner, threads, ckpt, clips, texts)
    print(f"  transformers: {ref['wall_s']:.1f} s, {ref['rtfx']:.1f} audio-s per s", flush=True)
    agree = agreement(ours["words"], ref["words"])
    cpu = machine["cpu"]
    report = dict(title=f"Qwen3-ForcedAligner-0.6B dims (random weights), {n} clips / {sum(lengths):.0f} s, "
                  f"{n_words} words, bf16, {threads} CPU threads, torch {torch.__version__}; {cpu['model']}",
                  workload=dict(clips_s=lengths, words_per_second=WORDS_PER_SECOND, words=n_words,
                                language=LANGUAGE),
                  machine=machine, qasr=ours, reference=ref, speedup=ours["rtfx"] / ref["rtfx"], agreement=agree,
                  total_wall_s=time.perf_counter() - t0)
    stem = "aligner_quick" if args.quick else "aligner"
    save_report(report, args.out, stem, plot, machine)
    print(table(report))
    print(f"\nword times, qasr against transformers ({agree['words']} words of {agree['clips']} clips): "
          f"{100 * agree['exact']:.1f}% equal, {100 * agree['within_80ms']:.1f}% within 80 ms; "
          f"{agree['distinct_starts']} distinct start times"
          + (" (random head: nearly one class everywhere, so agreement says little)"
             if agree["distinct_starts"] <= 2 else ""))
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    print(summary_line(report))
    return 0


def table(report: dict) -> str:
    rows = ["| side | clips | audio s | wall s | audio-s per s | peak RSS GiB | others' CPU |",
            "|---|---|---|---|---|---|---|"]
    n = report["agreement"]["clips"]
    for name, r in (("transformers token classification, batch 8", report["reference"]),
                    ("qasr Aligner.submit_pieces", report["qasr"])):
        rows.append(f"| {name} | {n} | {r['audio_s']:.0f} | {r['wall_s']:.1f} | {r['rtfx']:.1f} | "
                    f"{r['peak_rss_gib']:.2f} | {100 * r['foreign_cpu_share']:.0f}% |")
    for name, r in (("transformers", report["reference"]), ("qasr", report["qasr"])):
        if r["foreign_cpu_share"] > CONTENDED:
            rows.append(f"WARNING: other processes used {100 * r['foreign_cpu_share']:.0f}% of the CPUs during the "
                        f"{name} side: its figures are not representative of this machine")
    return "\n".join(rows)
