"""Train the small demo forced aligner (exact Qwen3-ForcedAligner architecture) on make_aligner_data.py's clips.

Why this exists: qasr's aligner path (``qasr.Aligner``, word timestamps in transcribe) needs a checkpoint
that really times speech offline, and the released aligner cannot be downloaded everywhere. This trains
the released architecture at demo size with qasr's OWN modules (encoder, decoder, log-mel, the aligner
prompt builder, the tokenizer files) and saves it in the original release layout, so loading it runs
exactly the code path of the real checkpoint.

The network is the ASR network with its LM head replaced by a ``Linear(hidden -> classify_num)``
timestamp classifier (class k = k x 80 ms). The encoder and decoder start from the ASR demo model
(models/qasr-demo-en), which already hears this speech; the classifier starts from scratch. The input is
the official aligner layout (qasr.align.aligner.build_aligner_prompt):
``<|audio_start|><|audio_pad|>*T<|audio_end|>w1<timestamp><timestamp>w2...``, one causal forward, and
the loss is cross-entropy at the ``<timestamp>`` slots, the targets being round(time / 80 ms) of each
word's true start and end, plus an auxiliary one at the audio positions (see Trainer.logits) and, with
--guide-weight, one on where some heads look from each slot (GuidedAttentionStore).
Augmentation: speed perturbation 0.9-1.1 (times scaled with it), random gain, two frequency masks.

    # --init-commit: the ASR demo model as of that commit (a copy under data/; the working copy may change)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_aligner_model.py --data data/aligner \\
        --out models/qasr-demo-aligner-en --init-commit 73664e6 --steps 6000 --guide-weight 1.0 \\
        --time-schedule --max-minutes 45

Deterministic for a seed and thread count, unless --time-schedule ties the learning rate to the clock.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch
import torch.nn.functional as F
from torch import nn

from qasr.align.aligner import build_aligner_prompt
from qasr.audio.features import LogMel
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import ModelConfig, post_conv_length
from qasr.model.prompt import SpecialTokens
from qasr.model.tokenizer import Tokenizer
from qasr.model.weights import load_model
from qasr.testing.checkpoint import _configs, _rename, _save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import PackedCausalStore, voice_mix  # noqa: E402 - causal attention over packed clips; the card

SR = 16000
SEGMENT_MS = 80  # one class; the release's timestamp_segment_time
CLASSES = 400  # 400 x 80 ms = 32 s: room for the 30 s clips (the release has 5000 classes, 400 s)
INIT_DIR = "models/qasr-demo-en"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
DIM_KEYS = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "downsample_hidden_size",
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim")


@dataclass
class Utt:
    wave: np.ndarray  # int16, 16 kHz
    words: list[tuple[str, float, float]]  # (word, start s, end s) in the clip
    voice: str
    kind: str  # sentence, multi or words (see make_aligner_data.py)


def load_split(manifest: Path, limit: int | None = None) -> list[Utt]:
    out = []
    for line in manifest.read_text().splitlines()[:limit]:
        row = json.loads(line)
        wave, sr = sf.read(manifest.parent / row["path"], dtype="int16")
        assert sr == SR, f"{row['path']}: {sr} Hz"
        out.append(Utt(wave, [tuple(w) for w in row["words"]], row["voice"], row["kind"]))
    return out


def export_init(commit: str, dest: Path) -> Path:
    """A fixed copy of the ASR demo model from git (the working copy may be retrained meanwhile)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):
        blob = subprocess.run(["git", "show", f"{commit}:{INIT_DIR}/{name}"], check=True, capture_output=True).stdout
        (dest / name).write_bytes(blob)
    return dest


def aligner_config(init: Path, classes: int) -> tuple[dict, dict[str, int], dict[str, int]]:
    """The release-layout aligner config for the ASR model's dimensions, its dims and added-token ids."""
    original = json.loads((init / "config.json").read_text())["thinker_config"]
    sections = (original["audio_config"], original["text_config"])
    dims = {k: int(next(sec[k] for sec in sections if k in sec)) for k in DIM_KEYS}
    added = json.loads((init / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {v["content"]: int(k) for k, v in added.items()}
    config, _ = _configs(dims, specials, original["text_config"]["vocab_size"], tied=False, classify_num=classes)
    config["support_languages"] = ["English"]  # the aligner reads the list from here
    return config, dims, specials


def build_model(init: Path, config: dict) -> Qwen3ASRModel:
    """The aligner network with the ASR demo model's encoder and decoder; a fresh classifier."""
    cfg = ModelConfig.from_dict(config)
    asr = load_model(init, ModelConfig.from_file(init / "config.json"), torch.device("cpu"), torch.float32)
    model = Qwen3ASRModel(cfg)
    state = {k: v for k, v in asr.state_dict().items() if not k.startswith("lm_head.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    nn.init.normal_(model.lm_head.weight, std=0.02)
    model.init_buffers("cpu")
    return model


class GuidedAttentionStore:
    """PackedCausalStore that also scores where chosen heads of chosen layers look from each timestamp slot.

    Why: a slot's time is easy once it attends to the right audio token (the auxiliary loss teaches every
    audio token its own time), but finding that token (which "five" of a word run, which "the" of three
    sentences) is what an under-trained aligner gets wrong. Here a few heads are told where to look: the
    loss is -log of the attention mass, in the head's causal softmax, on the audio tokens within one token
    of the slot's true boundary. Training only; the other heads stay free and the network is unchanged."""

    def __init__(self, lens: list[int], layers: tuple[int, ...], heads: tuple[int, ...],
                 queries: list[int], keys: list[int], starts: list[int]) -> None:
        self.inner = PackedCausalStore(lens)
        self.layers, self.heads = layers, heads
        self.queries = torch.tensor(queries, dtype=torch.long)  # packed row of each slot
        self.keys = torch.tensor(keys, dtype=torch.long)  # packed row of the audio token at its boundary
        self.starts = torch.tensor(starts, dtype=torch.long)  # packed row where its sequence begins
        self.losses: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object) -> torch.Tensor:
        if layer in self.layers and len(self.queries):
            group = q.shape[1] // k.shape[1]
            qs = q[self.queries][:, list(self.heads)]  # (S, h, d)
            ks = k[:, [h // group for h in self.heads]]  # (N, h, d)
            scores = torch.einsum("shd,nhd->shn", qs.float(), ks.float()) / math.sqrt(q.shape[-1])
            rows = torch.arange(k.shape[0])
            allowed = (rows[None] >= self.starts[:, None]) & (rows[None] <= self.queries[:, None])
            logp = scores.masked_fill(~allowed[:, None], float("-inf")).log_softmax(-1)
            window = (self.keys[:, None] + torch.arange(-1, 2)[None]).clamp(0, k.shape[0] - 1)  # (S, 3)
            near = logp.gather(-1, window[:, None].expand(-1, logp.shape[1], -1))
            self.losses.append(-torch.logsumexp(near, -1).mean())
        return self.inner.attend(layer, q, k, v, meta)


class Trainer:
    def __init__(self, model: Qwen3ASRModel, tok: Tokenizer, special: SpecialTokens) -> None:
        self.model, self.tok, self.special = model, tok, special
        self.logmel = LogMel()
        self.timestamp_id = int(model.cfg.timestamp_token_id)  # type: ignore[arg-type]
        self.classes = int(model.cfg.classify_num)  # type: ignore[arg-type]

    def features(self, u: Utt, rng: np.random.Generator | None) -> tuple[torch.Tensor, float]:
        """Log-mel of one clip (augmented when ``rng`` is given) and its speed factor."""
        wave = u.wave.astype(np.float32) / 32768.0
        speed = 1.0
        if rng is not None:
            speed = float(rng.uniform(0.9, 1.1))
            wave = soxr.resample(wave, SR * speed, SR).astype(np.float32)  # shorter by the factor `speed`
            wave = np.clip(wave * 10 ** (rng.uniform(-10, 6) / 20), -1, 1)
        f = self.logmel(wave)
        if rng is not None:
            f = f.clone()
            for _ in range(2):  # frequency masks only: a time mask would hide the very boundaries to learn
                w = int(rng.integers(0, 16))
                s = int(rng.integers(0, f.shape[0] - w + 1))
                f[s:s + w] = float(f.mean())
        return f, speed

    def logits(self, utts: list[Utt], rng: np.random.Generator | None, audio_rows: bool = False,
               guide: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, int, list[torch.Tensor]]:
        """Classifier logits and target classes at every timestamp slot of the batch, and how many slots.

        With ``audio_rows`` the audio placeholder positions follow, each labelled with its own start time
        (token k of 1 s chunk c starts at c s + k x 80 ms, i.e. class round(12.5 c + k)): an auxiliary
        task that makes the decoder carry each audio token's absolute time in its hidden state, which a
        timestamp slot then only has to copy from the audio it attends to. Without it the decoder must
        discover time by itself (the encoder's positions restart every 1 s chunk), which the official
        model could afford and a 40-minute run cannot.

        With ``guide`` = (layers, heads), the attention losses of GuidedAttentionStore come back too."""
        feats, speeds = zip(*(self.features(u, rng) for u in utts), strict=True)
        audio = self.model.audio_tower(list(feats))
        ids, lens, rows, targets, extra_rows, extra_targets = [], [], [], [], [], []
        chunk = self.model.cfg.encoder.conv_chunk_frames
        guide_keys, guide_starts = [], []
        for a, u, f, speed in zip(audio, utts, feats, speeds, strict=True):
            prompt = build_aligner_prompt(self.tok, self.special, self.timestamp_id, a.shape[0],
                                          [w for w, _, _ in u.words])
            rows += [len(ids) + s for s in prompt.slots]
            times_ms = [t / speed * 1000 for _, start, end in u.words for t in (start, end)]
            targets += [min(self.classes - 1, round(t / SEGMENT_MS)) for t in times_ms]
            frames = f.shape[1]  # 10 ms each; token k of the chunk starting at frame c starts at frame c + 8 k
            starts_ms = np.array([10 * (c + 8 * k) for c in range(0, frames, chunk)
                                  for k in range(post_conv_length(min(chunk, frames - c)))])
            assert len(starts_ms) == a.shape[0]
            guide_keys += [len(ids) + 1 + int(np.abs(starts_ms - t).argmin()) for t in times_ms]
            guide_starts += [len(ids)] * len(times_ms)
            if audio_rows:
                extra_rows += [len(ids) + 1 + j for j in range(len(starts_ms))]
                extra_targets += [min(self.classes - 1, round(t / SEGMENT_MS)) for t in starts_ms]
            ids += prompt.ids
            lens.append(len(prompt.ids))
        positions = torch.cat([torch.arange(n) for n in lens])
        store: PackedCausalStore | GuidedAttentionStore = PackedCausalStore(lens)
        if guide is not None:
            store = GuidedAttentionStore(lens, guide[0], guide[1], rows, guide_keys, guide_starts)
        out = self.model(torch.tensor(ids), positions, store, None,  # type: ignore[arg-type]
                         logits_rows=torch.tensor(rows + extra_rows), audio_embeds=torch.cat(audio))
        losses = store.losses if isinstance(store, GuidedAttentionStore) else []
        return out, torch.tensor(targets + extra_targets), len(rows), losses

    @torch.no_grad()
    def error_ms(self, utts: list[Utt]) -> float:
        """Mean |argmax class - target| in ms over all slots (no monotonic repair): a progress figure."""
        self.model.eval()
        errs = []
        for i in range(0, len(utts), 8):
            logits, targets, _, _ = self.logits(utts[i:i + 8], None)
            errs.append((logits.argmax(-1) - targets).abs().float() * SEGMENT_MS)
        self.model.train()
        return float(torch.cat(errs).mean())


def batches(utts: list[Utt], seconds: float, rng: np.random.Generator) -> list[list[Utt]]:
    """Shuffled batches of similar duration, each holding about ``seconds`` of audio."""
    order = sorted(range(len(utts)), key=lambda i: len(utts[i].wave) + rng.uniform(0, 0.5 * SR))
    out, cur, total = [], [], 0.0
    for i in order:
        cur.append(utts[i])
        total += len(utts[i].wave) / SR
        if total >= seconds:
            out.append(cur)
            cur, total = [], 0.0
    if cur:
        out.append(cur)
    rng.shuffle(out)  # type: ignore[arg-type]
    return out


def lr_at(step: int, total: int, peak: float, warmup: int, time_share: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 3% of the peak over the steps (or ``time_share`` of the time)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_share)
    return peak * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save(model: Qwen3ASRModel, config: dict, specials: dict[str, int], init: Path, out: Path,
         dtype: torch.dtype) -> None:
    """config/generation/preprocessor JSON, the ASR demo's tokenizer files and ``thinker.*`` safetensors."""
    config = json.loads(json.dumps(config))
    config["thinker_config"]["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((init / name).read_bytes())
    eos = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    (out / "generation_config.json").write_text(json.dumps(
        dict(eos_token_id=eos, pad_token_id=specials["<|endoftext|>"]), indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(
        dict(feature_extractor_type="WhisperFeatureExtractor", feature_size=128, sampling_rate=SR, hop_length=160,
             n_fft=400, chunk_length=30, padding_value=0.0, return_attention_mask=True, padding_side="right",
             dither=0.0), indent=2))
    state = {_rename(k, "original"): v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    _save(state, out, shards=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data/aligner"))
    ap.add_argument("--out", type=Path, default=Path("models/qasr-demo-aligner-en"))
    ap.add_argument("--init", type=Path, default=Path(INIT_DIR), help="the ASR demo model to start from")
    ap.add_argument("--init-commit", default=None,
                    help="take the ASR demo model from this git commit instead (a copy under data/)")
    ap.add_argument("--classes", type=int, default=CLASSES)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-seconds", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--head-lr", type=float, default=3e-3, help="the fresh classifier learns faster")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--position-weight", type=float, default=0.5,
                    help="weight of the auxiliary loss: each audio position predicts its own time class")
    ap.add_argument("--guide-weight", type=float, default=0.0,
                    help="weight of the attention loss: guided heads look at each slot's boundary audio")
    ap.add_argument("--guide-layers", default="2,3", help="decoder layers whose guided heads are trained to look")
    ap.add_argument("--guide-heads", default="0", help="query heads guided in each of those layers")
    ap.add_argument("--train-limit", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--max-minutes", type=float, default=40.0, help="stop (and save) past this wall time")
    ap.add_argument("--time-schedule", action="store_true",
                    help="decay the learning rate over --max-minutes when that ends first")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)

    init = export_init(args.init_commit, args.data / "init") if args.init_commit else args.init
    train = load_split(args.data / "train.jsonl", args.train_limit)
    val = load_split(args.data / "val.jsonl")
    monitor = [u for kind in ("sentence", "multi", "words") for u in [u for u in val if u.kind == kind][:12]]
    print(f"loaded {len(train)} train / {len(val)} val clips in {time.time() - t0:.0f} s", flush=True)

    config, dims, specials = aligner_config(init, args.classes)
    model = build_model(init, config)
    tok = Tokenizer.from_dir(init)
    cfg = model.cfg
    special = SpecialTokens.resolve(tok, cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id)
    trainer = Trainer(model, tok, special)
    head = [model.lm_head.weight]
    body = [p for n, p in model.named_parameters() if not n.startswith("lm_head.")]
    groups = [dict(params=[p for p in body if p.ndim >= 2], weight_decay=0.01, peak=args.lr),
              dict(params=[p for p in body if p.ndim < 2], weight_decay=0.0, peak=args.lr),
              dict(params=head, weight_decay=0.0, peak=args.head_lr)]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f} M params, {args.classes} classes, dims {dims}", flush=True)
    print(f"  val monitor: mean slot error {trainer.error_ms(monitor):.0f} ms before training", flush=True)

    guide = None
    if args.guide_weight > 0:
        guide = (tuple(int(x) for x in args.guide_layers.split(",")),
                 tuple(int(x) for x in args.guide_heads.split(",")))
    model.train()
    step, seen, loss_sum, guide_sum = 0, 0.0, 0.0, 0.0
    pending: list[list[Utt]] = []
    stopped_early = False
    while step < args.steps:
        if not pending:
            pending = batches(train, args.batch_seconds, rng)
        batch = pending.pop()
        share = (time.time() - t0) / 60 / args.max_minutes if args.time_schedule else 0.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, g["peak"], args.warmup, share)
        logits, targets, n, guided = trainer.logits(batch, rng, audio_rows=args.position_weight > 0, guide=guide)
        loss = F.cross_entropy(logits[:n], targets[:n])
        if args.position_weight > 0:
            loss = loss + args.position_weight * F.cross_entropy(logits[n:], targets[n:])
        if guided:
            guide_loss = torch.stack(guided).mean()
            loss = loss + args.guide_weight * guide_loss
            guide_sum += guide_loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += sum(len(u.wave) for u in batch) / SR
        loss_sum += loss.item()
        if step % 50 == 0:
            print(f"step {step} loss {loss_sum / 50:.3f} (attention {guide_sum / 50:.3f}) "
                  f"lr {opt.param_groups[0]['lr']:.2e} audio {seen / 3600:.1f} h {(time.time() - t0) / 60:.1f} min",
                  flush=True)
            loss_sum = guide_sum = 0.0
        if step % args.eval_every == 0:
            print(f"  val monitor: mean slot error {trainer.error_ms(monitor):.0f} ms", flush=True)
        if (time.time() - t0) / 60 > args.max_minutes:
            print(f"stopping early at step {step}: past {args.max_minutes} min", flush=True)
            stopped_early = True
            break

    print(f"  val monitor: mean slot error {trainer.error_ms(monitor):.0f} ms after training", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, config, specials, init, args.out, getattr(torch, args.save_dtype))
    minutes = (time.time() - t0) / 60
    hours = sum(len(u.wave) for u in train) / SR / 3600
    early = ", stopped by --max-minutes" if stopped_early else ""
    source = str(args.init)
    if args.init_commit:
        commit = subprocess.run(["git", "rev-parse", "--short", args.init_commit], check=True, capture_output=True,
                                text=True).stdout.strip()
        source = f"{INIT_DIR} as of commit {commit}"
    command = " ".join(["scripts/train_aligner_model.py", *_cli(args, ap)])
    run = (f"Encoder and decoder from the ASR demo model ({source}); {step} steps ({seen / 3600:.1f} h of audio "
           f"seen, {seen / 3600 / hours:.1f} passes over the data) in {minutes:.1f} min on {args.threads} CPU "
           f"thread(s){early}; seed {args.seed}; command: `{command}`")
    guided = ""
    if guide is not None:
        guided = (f", and (weight {args.guide_weight:g}) an attention loss: query head(s) {args.guide_heads} of "
                  f"decoder layer(s) {args.guide_layers} are trained to put their attention, from each slot, on the "
                  "audio tokens within one token of its true boundary (`GuidedAttentionStore`; the network is "
                  "unchanged)")
    write_card(args.out, dims, n_params, args.classes, train, hours, run, args.save_dtype, guided)
    print(f"saved {args.out} after {minutes:.1f} min", flush=True)


def _cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The options that differ from their defaults, as command-line text."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
            if v != parser.get_default(k)]


def write_card(out: Path, dims: dict[str, int], n_params: int, classes: int, train: list[Utt], hours: float,
               run: str, dtype: str, guided: str = "") -> None:
    """The model card; the evaluation section (written by eval_aligner_model.py) is kept."""
    card = out / "README.md"
    kinds = Counter(u.kind for u in train)
    seconds: Counter[str] = Counter()
    for u in train:
        seconds[u.kind] += len(u.wave) / SR
    mix = ", ".join(f"{kinds[k]} {label} ({seconds[k] / 3600:.1f} h)" for k, label in (
        ("sentence", "single sentences"), ("multi", "runs of several sentences"), ("words", "random word runs"))
        if kinds[k])
    evaluation = "Not measured yet: run `scripts/eval_aligner_model.py --update-card`."
    if card.exists() and "<!-- eval:start -->" in card.read_text():
        evaluation = card.read_text().split("<!-- eval:start -->")[1].split("<!-- eval:end -->")[0].strip()
    enc = ", ".join(f"{k} {dims[k]}" for k in DIM_KEYS[:5])
    dec = ", ".join(f"{k} {dims[k]}" for k in DIM_KEYS[5:])
    card.write_text(f"""# qasr-demo-aligner-en

A toy English forced aligner with the exact Qwen3-ForcedAligner architecture ({n_params / 1e6:.1f} M
parameters), trained with qasr's own model code so that word timestamps can be produced and tested
offline. It is **not** Qwen3-ForcedAligner: it knows only synthetic espeak-ng voices and the demo grammar's
words, and it times clips of at most {classes * SEGMENT_MS / 1000:.0f} s.

```python
from qasr import Aligner
aligner = Aligner.from_pretrained("models/qasr-demo-aligner-en")
words = aligner.align("clip.wav", "turn on the lights in the kitchen", "English")[0]
```

## Files

The original release layout of the aligner: `config.json` (`thinker_config.model_type`
`qwen3_forced_aligner`, `thinker_config.classify_num` {classes}, `timestamp_token_id`,
`timestamp_segment_time` {SEGMENT_MS}, `support_languages` ["English"]), `generation_config.json`,
`preprocessor_config.json`, the tokenizer files of models/qasr-demo-en (`vocab.json`, `merges.txt`,
`tokenizer_config.json`, with `<timestamp>`), and `model.safetensors` with `thinker.*` keys in {dtype}.

- audio encoder: {enc}; num_mel_bins 128, n_window 50, n_window_infer 800 (as released)
- text decoder: {dec}
- head: `thinker.lm_head.weight`, the timestamp classifier Linear(hidden -> {classes}), no bias: class k is
  k x {SEGMENT_MS} ms, so times up to {classes * SEGMENT_MS / 1000:.0f} s can be expressed

## Training data

`scripts/make_aligner_data.py`: {len(train)} clips ({hours:.1f} h) of espeak-ng speech: {mix}. Sentences
from the ASR demo's grammar (commands, numbers, dates, clock times, spelled codes, short everyday
sentences); several-sentence clips join sentences of one voice with 0.1-2.5 s pauses, word runs are random
number words, letter/digit codes or any grammar words; clips last 1-30 s with 0.05-1.5 s of silence at
both ends, at a random level, with white, pink, brown noise or mains hum at 15-40 dB SNR (10% clean).
Voices: {voice_mix(train)}, speed 130-190 wpm, pitch 25-75.

Word times are espeak-ng's own: its synthesis callback reports the sample where each word starts; a
word spans from there to the next word's start, trimmed to its audible part (5 ms frames of the clean
speech more than 40 dB below the loudest frame are cut from both edges, so pauses, and a stop's closure
when it is silent, belong to no word). espeak-ng speaks "on the" / "in the" as one word; those are split at the
phoneme events, by each word's phoneme count. The held-out split: validation sentences are the ASR
demo data's validation sentences (heard by neither model), half of the validation sentence and
multi-sentence clips and all validation word runs use voices from accents and variants never trained on
(en-us-nyc, en-gb-x-gbcwmd; f5, m7), the word runs at speeds outside 130-190 wpm.

## Training

`scripts/train_aligner_model.py`: the official aligner input (`<|audio_start|>`, the audio placeholders,
`<|audio_end|>`, then each word followed by two `<timestamp>` tokens), one causal forward, cross-entropy
at the `<timestamp>` slots against round(time / {SEGMENT_MS} ms) of each word's start and end, plus (weight
0.5) an auxiliary cross-entropy of the same head at every audio placeholder against that audio token's
own start time, so that the decoder carries absolute time in its hidden states (the encoder's positions
restart every 1 s chunk) and a slot has only to copy it from the audio it attends to{guided}. AdamW,
warm-up then cosine decay, the fresh classifier at a higher learning rate; speed perturbation 0.9-1.1
(targets scaled with it), random gain, frequency masks. {run}.

## Evaluation

<!-- eval:start -->
{evaluation}
<!-- eval:end -->

## Limits

- English only, espeak-ng voices only, the demo grammar's words; real human speech and unknown words
  are untested and will time worse.
- Times are multiples of {SEGMENT_MS} ms (one class): even a perfect model is off by up to 40 ms.
- At most {classes * SEGMENT_MS / 1000:.0f} s per clip (`Aligner.max_seconds`); the training clips last at
  most 30 s. Cut longer audio into pieces and pass their offsets.
- The truth it learned is espeak-ng's word boundaries trimmed to sound: inside continuous speech a word
  starts where espeak-ng starts it (a stop's closure included); after a pause, at its first audible frame
  (a stop's burst).
- The transcript must be right: it times the words it is given, whatever the audio says.
""")


if __name__ == "__main__":
    main()
