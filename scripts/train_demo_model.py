"""Train the small demo model (exact Qwen3-ASR architecture) on the synthetic data of make_demo_data.py.

Why this exists: qasr needs a checkpoint that really recognises speech offline, for the demo and for
end-to-end tests, and the released weights cannot be downloaded everywhere. So a few-million-parameter
model with the released architecture is trained here with qasr's OWN modules (encoder, decoder, log-mel,
prompt builder, tokenizer files), and saved in the original release layout, so that loading it
exercises exactly the code path of the real checkpoints.

Training is plain teacher forcing on the official prompt: the assistant turn is
``language English<asr_text>{text}<|im_end|>`` (``language None<asr_text><|im_end|>`` for clips without
speech) and only those tokens are scored. Two auxiliary heads on the audio embeddings, thrown away at
save time, make the encoder learn to hear within a one-core budget: frame-level phoneme classification
against the phoneme times espeak-ng reported while synthesising (the big win: transcript-only training
was still above 70% WER after 15 minutes), and CTC on the transcript tokens.
Augmentation: speed perturbation, random gain, SpecAugment-style masks.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_demo_model.py --data data/demo --out models/qasr-demo-en

``--init DIR`` fine-tunes a saved demo model instead of starting from scratch: its weights, dimensions
and tokenizer files are kept (the auxiliary heads start afresh), so new kinds of data (long multi-sentence
clips, random word runs, long non-speech) can be taught in an hour without relearning to hear:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_demo_model.py --init models/qasr-demo-en \
        --out /tmp/demo-new --steps 3000 --lr 4e-4 --warmup 150 --batch-seconds 40

For the long kinds, fine-tuning can weight the kinds (``--kind-weights words=2,multi=2``: a clip of weight
w is drawn w times per pass, fractions at random), add long clips joined on the fly from clips of one voice
(``--concat-clips N`` per pass: 8-30 s of single sentences and word runs back to back, so the decoder sees
ever new long sequences instead of memorising the fixed multi-sentence clips), and check progress through
the fast ``qasr.ASR`` path (``--check-minutes M``: save a checkpoint and run scripts/eval_demo_model.py on
it; the in-loop greedy check recomputes every step without a cache and costs minutes on long clips).

Deterministic for a given seed and thread count (one thread by default: the budget is 45 min on one core).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
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

from qasr.audio.features import LogMel
from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import ModelConfig, post_conv_length
from qasr.model.prompt import SpecialTokens, build_prompt
from qasr.model.tokenizer import Tokenizer
from qasr.model.weights import load_model
from qasr.testing.checkpoint import _configs, _rename, _save
from qasr.testing.tokenizer_files import write_tiny_tokenizer

SR = 16000
DIMS: dict[str, int] = dict(
    d_model=256, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=1024, downsample_hidden_size=32,
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64,
)


@dataclass
class Utt:
    wave: np.ndarray  # int16, 16 kHz
    text: str
    voice: str
    phones: list[tuple[str, float, float]]  # (espeak phoneme, start s, end s) in the clip
    kind: str  # sentence, multi, words or nonspeech (see make_demo_data.py)


def load_split(manifest: Path, limit: int | None = None) -> list[Utt]:
    rows = [json.loads(line) for line in manifest.read_text().splitlines()][:limit]
    out = []
    for row in rows:
        wave, sr = sf.read(manifest.parent / row["path"], dtype="int16")
        assert sr == SR, f"{row['path']}: {sr} Hz"
        kind = row.get("kind", "sentence" if row["text"] else "nonspeech")  # manifests before the kinds
        out.append(Utt(wave, row["text"], row["voice"], [tuple(p) for p in row.get("phones", [])], kind))
    return out


def phone_inventory(utts: list[Utt]) -> dict[str, int]:
    """Phoneme symbol -> class; class 0 is silence (espeak's pauses start with "_", plus unlabelled time)."""
    symbols = sorted({p for u in utts for p, _, _ in u.phones if not p.startswith("_")})
    return {s: i + 1 for i, s in enumerate(symbols)}


def phone_targets(phones: list[tuple[str, float, float]], inventory: dict[str, int], speed: float,
                  token_counts: list[int], frames: int) -> torch.Tensor:
    """Soft per-token phoneme targets: each encoder token's share of time spent in each phoneme.

    Token j of 1 s chunk c covers mel frames [100 c + 8 j, 100 c + 8 j + 8) (three stride-2 convs);
    times are divided by ``speed`` because speed perturbation shortened the clip.
    """
    starts, ends = [], []
    for c, n in enumerate(token_counts):
        f0 = 100 * c + 8 * np.arange(n)
        starts.append(f0)
        ends.append(np.minimum(f0 + 8, min(100 * (c + 1), frames)))
    lo, hi = np.concatenate(starts) / 100.0, np.concatenate(ends) / 100.0
    target = np.zeros((len(lo), len(inventory) + 1), np.float32)
    for sym, a, b in phones:
        k = inventory.get(sym, 0)
        target[:, k] += np.clip(np.minimum(hi, b / speed) - np.maximum(lo, a / speed), 0, None)
    target[:, 0] += np.clip((hi - lo) - target.sum(1), 0, None)
    return torch.from_numpy(target / np.maximum(target.sum(1, keepdims=True), 1e-6))


class PackedCausalStore:
    """Cache-free KVStore for training: causal attention within each packed sequence, differentiable.

    Sequences are scattered into a padded (batch, max_len) layout so one SDPA call serves the batch;
    lengths are similar within a batch (duration buckets), so little work goes to padding.
    """

    def __init__(self, lens: list[int]) -> None:
        total, longest = sum(lens), max(lens)
        index = torch.full((len(lens), longest), total, dtype=torch.long)
        offset = 0
        for i, n in enumerate(lens):
            index[i, :n] = torch.arange(offset, offset + n)
            offset += n
        self.index = index
        self.valid = (index < total).reshape(-1)
        causal = torch.ones(longest, longest, dtype=torch.bool).tril()
        self.mask = (causal[None] & (index < total)[:, None, :])[:, None]  # (B, 1, L, L)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object) -> torch.Tensor:
        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.index].transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, out.shape[1] * out.shape[3])[self.valid]


class Trainer:
    def __init__(self, model: Qwen3ASRModel, tok: Tokenizer, special: SpecialTokens, args: argparse.Namespace,
                 phones: dict[str, int]):
        self.model, self.tok, self.special, self.args, self.phones = model, tok, special, args, phones
        self.logmel = LogMel()
        lang = {True: tok.encode("language English"), False: tok.encode("language None")}
        self.prefix = {k: [*v, special.asr_text] for k, v in lang.items()}
        vocab = model.cfg.decoder.vocab_size
        self.ctc_head = nn.Linear(model.cfg.decoder.hidden_size, vocab + 1)  # last index = CTC blank
        self.phone_head = nn.Linear(model.cfg.decoder.hidden_size, len(phones) + 1)
        self.speeds: list[float] = []

    def heads(self) -> list[nn.Module]:
        """Auxiliary training heads: trained, never saved."""
        return [self.ctc_head, self.phone_head]

    def target(self, text: str) -> list[int]:
        return [*self.prefix[bool(text)], *(self.tok.encode(text) if text else []), self.special.im_end]

    def features(self, utts: list[Utt], rng: np.random.Generator | None) -> list[torch.Tensor]:
        feats = []
        self.speeds = []
        for u in utts:
            wave = u.wave.astype(np.float32) / 32768.0
            speed = 1.0
            if rng is not None:
                speed = rng.uniform(*self.args.speed_range)
                wave = soxr.resample(wave, SR * speed, SR).astype(np.float32)
                wave *= 10 ** (rng.uniform(-10, 6) / 20)
                wave = np.clip(wave, -1, 1)
            f = self.logmel(wave)
            if rng is not None:
                if self.args.warp_range != (1.0, 1.0):
                    f = warp_mel(f, rng.uniform(*self.args.warp_range))
                f = spec_augment(f, rng)
            feats.append(f)
            self.speeds.append(speed)
        return feats

    def loss(self, utts: list[Utt], rng: np.random.Generator) -> tuple[torch.Tensor, float, float, float]:
        feats = self.features(utts, rng)
        audio = self.model.audio_tower(feats)
        ids, lens, rows, labels = [], [], [], []
        for a, u in zip(audio, utts, strict=True):
            prompt = build_prompt(self.tok, self.special, a.shape[0])
            tgt = self.target(u.text)
            base = len(ids)
            rows += range(base + len(prompt) - 1, base + len(prompt) + len(tgt) - 1)
            labels += tgt
            ids += prompt + tgt
            lens.append(len(prompt) + len(tgt))
        positions = torch.cat([torch.arange(n) for n in lens])
        logits = self.model(torch.tensor(ids), positions, PackedCausalStore(lens), None,  # type: ignore[arg-type]
                            logits_rows=torch.tensor(rows), audio_embeds=torch.cat(audio))
        ce = F.cross_entropy(logits, torch.tensor(labels), label_smoothing=self.args.label_smoothing)
        ctc = self.ctc(audio, utts) if self.args.ctc_weight > 0 else torch.zeros(())
        phone = self.phone_loss(audio, utts, feats) if self.args.phone_weight > 0 else torch.zeros(())
        total = ce + self.args.ctc_weight * ctc + self.args.phone_weight * phone
        return total, ce.item(), ctc.item(), phone.item()

    def phone_loss(self, audio: list[torch.Tensor], utts: list[Utt], feats: list[torch.Tensor]) -> torch.Tensor:
        """Frame-level phoneme classification on the audio embeddings, from espeak-ng's phoneme times."""
        chunk = self.model.cfg.encoder.conv_chunk_frames
        targets = []
        for a, u, f, speed in zip(audio, utts, feats, self.speeds, strict=True):
            frames = f.shape[1]
            counts = [post_conv_length(min(chunk, frames - c)) for c in range(0, frames, chunk)]
            assert sum(counts) == a.shape[0]
            targets.append(phone_targets(u.phones, self.phones, speed, counts, frames))
        return F.cross_entropy(self.phone_head(torch.cat(audio)), torch.cat(targets))

    def ctc(self, audio: list[torch.Tensor], utts: list[Utt]) -> torch.Tensor:
        blank = self.model.cfg.decoder.vocab_size
        logp = self.ctc_head(nn.utils.rnn.pad_sequence(audio)).log_softmax(-1)  # (T, B, V + 1)
        targets = [self.tok.encode(u.text) if u.text else [] for u in utts]
        loss = F.ctc_loss(logp, torch.tensor([t for ts in targets for t in ts], dtype=torch.long),
                          torch.tensor([a.shape[0] for a in audio]), torch.tensor([len(t) for t in targets]),
                          blank=blank, reduction="sum", zero_infinity=True)
        return loss / max(1, sum(len(t) + 1 for t in targets))

    @torch.no_grad()
    def greedy(self, utts: list[Utt], max_new: int = 160) -> list[str]:
        """Greedy decoding without a KV cache (recomputes each step; fine for a quick progress check)."""
        self.model.eval()
        audio = self.model.audio_tower(self.features(utts, None))
        seqs = [build_prompt(self.tok, self.special, a.shape[0]) for a in audio]
        start = [len(s) for s in seqs]
        active = list(range(len(utts)))
        for _ in range(max_new):
            if not active:
                break
            lens = [len(seqs[i]) for i in active]
            ids = torch.tensor([t for i in active for t in seqs[i]])
            rows = torch.tensor(lens).cumsum(0) - 1
            logits = self.model(ids, torch.cat([torch.arange(n) for n in lens]), PackedCausalStore(lens),
                                None, logits_rows=rows,  # type: ignore[arg-type]
                                audio_embeds=torch.cat([audio[i] for i in active]))
            nxt = logits.argmax(-1).tolist()
            for i, t in zip(active, nxt, strict=True):
                seqs[i].append(t)
            active = [i for i, t in zip(active, nxt, strict=True) if t != self.special.im_end]
        self.model.train()
        texts = []
        for s, n in zip(seqs, start, strict=True):
            raw = self.tok.decode([t for t in s[n:] if t != self.special.im_end])
            texts.append(raw.split("<asr_text>", 1)[-1].strip())
        return texts


def warp_mel(f: torch.Tensor, factor: float) -> torch.Tensor:
    """Stretch the log-mel spectrogram (bins x frames) along frequency by ``factor`` (> 1 moves energy up).

    Why: speed perturbation moves formants and tempo together; an independent warp of the frequency axis
    (vocal-tract-length perturbation) also gives the voice of a longer or shorter vocal tract at the same
    tempo, so that the few hundred synthetic voices stand for more speakers. Bins that would come from above
    the top bin repeat it.
    """
    bins = f.shape[0]
    src = torch.arange(bins, dtype=torch.float32) / factor
    lo = src.floor().clamp(max=bins - 1).long()
    hi = (lo + 1).clamp(max=bins - 1)
    w = (src - lo.float()).clamp(0, 1)[:, None]
    return f[lo] * (1 - w) + f[hi] * w


def spec_augment(f: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Two frequency masks and up to two short time masks, filled with the utterance mean."""
    f = f.clone()
    fill = float(f.mean())
    for _ in range(2):
        w = int(rng.integers(0, 16))
        s = int(rng.integers(0, f.shape[0] - w + 1))
        f[s:s + w] = fill
    for _ in range(int(rng.integers(0, 3))):
        w = int(rng.integers(0, max(1, min(20, f.shape[1] // 10))))
        s = int(rng.integers(0, max(1, f.shape[1] - w)))
        f[:, s:s + w] = fill
    return f


Item = Utt | tuple[Utt, ...]  # a clip, or clips of one voice to be joined into one (see join)


def samples(item: Item) -> int:
    return sum(len(u.wave) for u in item) if isinstance(item, tuple) else len(item.wave)


def batches(utts: list[Item], seconds: float, rng: np.random.Generator) -> list[list[Item]]:
    """Shuffled batches of similar duration, each holding about ``seconds`` of audio."""
    order = sorted(range(len(utts)), key=lambda i: samples(utts[i]) + rng.uniform(0, 0.3 * SR))
    out, cur, total = [], [], 0.0
    for i in order:
        cur.append(utts[i])
        total += samples(utts[i]) / SR
        if total >= seconds:
            out.append(cur)
            cur, total = [], 0.0
    if cur:
        out.append(cur)
    rng.shuffle(out)  # type: ignore[arg-type]
    return out


def parse_weights(text: str) -> dict[str, float]:
    """``"words=2,multi=2.5"`` -> {"words": 2.0, "multi": 2.5}; kinds not named keep weight 1."""
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def epoch_items(train: list[Utt], weights: dict[str, float], concat: int, max_s: float,
                rng: np.random.Generator) -> list[Item]:
    """One pass: each clip drawn ``weights[kind]`` times (fractions at random), plus ``concat`` joined clips.

    A joined clip is 2 or more single sentences and word runs of one voice, back to back (each clip
    brings its own 0.05-0.8 s of padding, so the pauses are natural), 8 s to ``max_s`` long.
    """
    items: list[Item] = []
    for u in train:
        w = weights.get(u.kind, 1.0)
        items += [u] * (int(w) + int(rng.random() < w - int(w)))
    by_voice: dict[str, list[Utt]] = {}
    for u in train:
        if u.kind in ("sentence", "words"):
            by_voice.setdefault(u.voice, []).append(u)
    voices = sorted(by_voice)
    for _ in range(concat):
        pool = by_voice[voices[int(rng.integers(len(voices)))]]
        goal, parts, total = rng.uniform(8.0, max_s) * SR, [], 0
        for _ in range(64):
            u = pool[int(rng.integers(len(pool)))]
            if total + len(u.wave) > max_s * SR:
                continue
            parts.append(u)
            total += len(u.wave)
            if total >= goal:
                break
        if len(parts) >= 2:
            items.append(tuple(parts))
    return items


def join(item: Item, rng: np.random.Generator | None = None, max_s: float = 30.0, gap_s: float = 0.0) -> Utt:
    """A joined clip as one Utt: waves in order, texts joined, phoneme times shifted.

    With ``gap_s`` > 0, half the joins get an extra pause of up to ``gap_s`` seconds (as long as the clip
    stays within ``max_s``), filled with noise at the level of the clip's own leading padding: segments
    cut from long recordings hold pauses of several seconds between sentences, which the dataset's
    several-sentence clips (pauses of at most 1.2 s) never show, and a decoder that never heard one loses
    its place after it and repeats."""
    if not isinstance(item, tuple):
        return item
    budget = int(max_s * SR) - sum(len(u.wave) for u in item)
    waves, phones, offset = [], [], 0.0
    for i, u in enumerate(item):
        if i and rng is not None and gap_s > 0 and budget > 0 and rng.random() < 0.5:
            n = min(budget, int(rng.uniform(0.2, gap_s) * SR))
            floor = float(np.std(item[i - 1].wave[: SR // 20].astype(np.float32)))
            waves.append(np.clip(rng.normal(0.0, floor, n), -32768, 32767).astype(np.int16))
            budget -= n
            offset += n / SR
        waves.append(u.wave)
        phones += [(p, a + offset, b + offset) for p, a, b in u.phones]
        offset += len(u.wave) / SR
    return Utt(np.concatenate(waves), " ".join(u.text for u in item), item[0].voice, phones, "concat")


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    return jiwer.wer([r for r, _ in pairs], [h or "<empty>" for _, h in pairs])


def save(model: Qwen3ASRModel, dims: dict[str, int], specials: dict[str, int], out: Path, dtype: torch.dtype) -> None:
    """Write config/generation/preprocessor JSON and ``thinker.*`` safetensors (the original release layout)."""
    original, _ = _configs(dims, specials, model.cfg.decoder.vocab_size, tied=False)
    original["support_languages"] = ["English"]
    original["thinker_config"]["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(original, indent=2))
    eos = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    (out / "generation_config.json").write_text(json.dumps(
        dict(do_sample=False, eos_token_id=eos, pad_token_id=specials["<|endoftext|>"], max_new_tokens=128), indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(
        dict(feature_extractor_type="WhisperFeatureExtractor", feature_size=128, sampling_rate=SR, hop_length=160,
             n_fft=400, chunk_length=30, padding_value=0.0, return_attention_mask=True, padding_side="right",
             dither=0.0), indent=2))
    state = {_rename(k, "original"): v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    _save(state, out, shards=1)


def lr_at(step: int, total: int, peak: float, warmup: int, time_share: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 3% of the peak over the steps (or ``time_share`` of the time budget)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_share)
    return peak * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def init_weights(model: nn.Module) -> None:
    """Unit-gain init, with residual-branch outputs near zero; tuned for learning fast from scratch.

    Each linear layer keeps the signal scale (std = fan_in ** -0.5), the convs get He init, and the
    projections that write into a residual stream (out_proj/fc2, o_proj/down_proj) start tiny, so that
    at step 0 every transformer layer is close to the identity. With the usual N(0, 0.02) init the audio
    features start ~70x smaller than the sinusoidal positions added to them and the layers' near-uniform
    attention adds a common vector to every frame; the encoder then needed far more steps than a
    one-core budget allows before its CTC loss left the all-blank plateau.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            residual_out = name.endswith(("out_proj", "fc2", "o_proj", "down_proj"))
            nn.init.normal_(m.weight, std=0.003 if residual_out else m.in_features ** -0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.7)  # about the scale of the audio embeddings it sits next to
        elif isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)


TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def warm_start(init: Path, out: Path) -> tuple[Qwen3ASRModel, dict[str, int], dict[str, int]]:
    """Load a saved demo model in float32 for training; copy its tokenizer files to ``out``.

    Returns the model, its dimensions (as in DIMS) and the added-token ids, so that ``save`` writes the
    same layout and ids back: the fine-tuned model stays a drop-in replacement.
    """
    for name in TOKENIZER_FILES:
        if init.resolve() != out.resolve():
            shutil.copy(init / name, out / name)
    original = json.loads((init / "config.json").read_text())["thinker_config"]
    sections = (original["audio_config"], original["text_config"])
    dims = {k: int(next(sec[k] for sec in sections if k in sec)) for k in DIMS}
    added = json.loads((init / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {v["content"]: int(k) for k, v in added.items()}
    cfg = ModelConfig.from_file(init / "config.json")
    model = load_model(init, cfg, torch.device("cpu"), torch.float32).requires_grad_(True)
    return model, dims, specials


def monitor_set(val: list[Utt]) -> list[Utt]:
    """A fixed slice of validation for progress lines: sentences first, then a few short clips of other kinds.

    Short clips only (<= 12 s): the greedy check has no KV cache, and long clips made each check cost
    minutes. The long kinds are measured properly by --check-minutes.
    """
    first = {"sentence": 96, "words": 10, "nonspeech": 8}
    short = [u for u in val if len(u.wave) <= 12 * SR]
    return [u for kind, n in first.items() for u in [u for u in short if u.kind == kind][:n]]


def float_pair(text: str) -> tuple[float, float]:
    """A ``lo,hi`` command-line range."""
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data/demo"))
    ap.add_argument("--out", type=Path, default=Path("models/qasr-demo-en"))
    ap.add_argument("--init", type=Path, default=None, help="fine-tune this saved model, e.g. models/qasr-demo-en")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch-seconds", type=float, default=24.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--ctc-weight", type=float, default=0.3)
    ap.add_argument("--phone-weight", type=float, default=1.0)
    ap.add_argument("--label-smoothing", type=float, default=0.05)
    ap.add_argument("--vocab-budget", type=int, default=1000)
    ap.add_argument("--dims", default="", help="overrides, e.g. d_model=192,encoder_layers=3")
    ap.add_argument("--train-limit", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=1000, help="greedy progress check on short clips (0: never)")
    ap.add_argument("--check-minutes", type=float, default=0.0,
                    help="every this many minutes save a checkpoint under OUT/checkpoints and run "
                         "scripts/eval_demo_model.py on it (the fast qasr.ASR path; 0: never)")
    ap.add_argument("--kind-weights", default="", help="draws per pass of each kind of clip, e.g. words=2,multi=2")
    ap.add_argument("--concat-clips", type=int, default=0,
                    help="clips per pass joined on the fly from single sentences and word runs of one voice")
    ap.add_argument("--concat-max-seconds", type=float, default=29.5)
    ap.add_argument("--concat-gap-seconds", type=float, default=0.0,
                    help="extra pauses of up to this long in half the joins of --concat-clips (see join)")
    ap.add_argument("--speed-range", type=float_pair, default=(0.9, 1.1),
                    help="speed perturbation factors, e.g. 0.85,1.15")
    ap.add_argument("--warp-range", type=float_pair, default=(1.0, 1.0),
                    help="frequency-warp factors of the log-mel, drawn apart from the speed (see warp_mel), "
                         "e.g. 0.9,1.1; 1,1: off")
    ap.add_argument("--max-minutes", type=float, default=44.0, help="stop early (and save) past this wall time")
    ap.add_argument("--time-schedule", action="store_true",
                    help="decay the learning rate over --max-minutes when that ends first (on a shared CPU the "
                         "step rate is unknown in advance; the run then depends on the machine's speed)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    dims = {**DIMS, **{k: int(v) for k, v in (kv.split("=") for kv in args.dims.split(",") if kv)}}

    train = load_split(args.data / "train.jsonl", args.train_limit)
    val = load_split(args.data / "val.jsonl")
    monitor = monitor_set(val)
    print(f"loaded {len(train)} train / {len(val)} val clips in {time.time() - t0:.0f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.init is not None:
        model, dims, specials = warm_start(args.init, args.out)
        cfg = model.cfg
    else:
        corpus = "\n".join(sorted({u.text for u in train if u.text}))
        specials = write_tiny_tokenizer(args.out, extra_text=corpus, vocab_budget=args.vocab_budget)
        original, _ = _configs(dims, specials, max(specials.values()) + 1, tied=False)
        cfg = ModelConfig.from_dict(original)
        model = Qwen3ASRModel(cfg)
        init_weights(model)
        model.init_buffers("cpu")
    tok = Tokenizer.from_dir(args.out)
    special = SpecialTokens.resolve(tok, cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id)
    trainer = Trainer(model, tok, special, args, phone_inventory(train))
    heads = nn.ModuleList(trainer.heads())
    init_weights(heads)
    params = list(model.parameters()) + list(heads.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f} M params, vocab {cfg.decoder.vocab_size}, dims {dims}", flush=True)

    model.train()
    step, epoch, seen = 0, 0, 0.0
    pending: list[list[Item]] = []
    logs = np.zeros(3)
    stopped_early = False
    weights = parse_weights(args.kind_weights)
    next_check = args.check_minutes
    while step < args.steps:
        if not pending:
            items = epoch_items(train, weights, args.concat_clips, args.concat_max_seconds, rng)
            pending = batches(items, args.batch_seconds, rng)
            epoch += 1
        batch = [join(x, rng, args.concat_max_seconds, args.concat_gap_seconds) for x in pending.pop()]
        for g in opt.param_groups:
            share = (time.time() - t0) / 60 / args.max_minutes if args.time_schedule else 0.0
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup, share)
        loss, *parts = trainer.loss(batch, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += sum(len(u.wave) for u in batch) / SR
        logs += parts
        if step % 50 == 0:
            ce, ctc, phone = logs / 50
            print(f"step {step} epoch {epoch} ce {ce:.3f} ctc {ctc:.3f} phone {phone:.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} audio {seen / 3600:.1f} h {(time.time() - t0) / 60:.1f} min",
                  flush=True)
            logs[:] = 0
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            report(trainer, monitor)
        if args.check_minutes and (time.time() - t0) / 60 >= next_check:
            check(model, dims, specials, args, step)
            next_check = (time.time() - t0) / 60 + args.check_minutes
        if (time.time() - t0) / 60 > args.max_minutes:
            print(f"stopping early at step {step}: past {args.max_minutes} min", flush=True)
            stopped_early = True
            break

    save(model, dims, specials, args.out, getattr(torch, args.save_dtype))
    minutes = (time.time() - t0) / 60
    hours = sum(len(u.wave) for u in train) / SR / 3600
    early = ", stopped early by --max-minutes" if stopped_early else ""
    start = f"fine-tuned from {args.init.name}; " if args.init is not None else ""
    if weights or args.concat_clips:
        drawn = ", ".join(f"{k} x{w:g}" for k, w in weights.items())
        start += (f"clips drawn per pass by kind ({drawn or 'all x1'}) plus {args.concat_clips} clips joined "
                  f"on the fly from one voice's sentences and word runs (8-{args.concat_max_seconds:g} s")
        if args.concat_gap_seconds > 0:
            start += f", half the joins with an extra pause of 0.2-{args.concat_gap_seconds:g} s of noise"
        start += "); "
    run = (f"{start}{step} steps ({seen / 3600:.1f} h of audio seen, {seen / 3600 / hours:.1f} passes over the data) "
           f"in {minutes:.1f} min on {args.threads} CPU thread(s){early}; seed {args.seed}; "
           f"command: `{' '.join(['scripts/train_demo_model.py', *_cli(args, ap)])}`")
    write_card(args.out, dims, n_params, cfg.decoder.vocab_size, train, hours, run, args.save_dtype,
               args.speed_range, args.warp_range)
    print(f"saved {args.out} after {minutes:.1f} min", flush=True)


def check(model: Qwen3ASRModel, dims: dict[str, int], specials: dict[str, int], args: argparse.Namespace,
          step: int) -> None:
    """Save a checkpoint (as released) and measure it with scripts/eval_demo_model.py on one thread."""
    import os
    import subprocess
    import sys

    started = time.time()
    ckpt = args.out / "checkpoints" / f"step{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(args.out / name, ckpt / name)
    save(model, dims, specials, ckpt, getattr(torch, args.save_dtype))
    script = Path(__file__).resolve().parent / "eval_demo_model.py"
    try:  # a failed check must not end the run
        out = subprocess.run([sys.executable, str(script), "--model", str(ckpt), "--data", str(args.data),
                              "--threads", "1", "--show", "2"], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = out.stdout.splitlines() or out.stderr.splitlines()[-5:]
    except OSError as e:
        lines = [f"check failed: {e}"]
    print(f"  check {ckpt} ({time.time() - started:.0f} s):", flush=True)
    for line in lines:
        print(f"    {line}", flush=True)


def report(trainer: Trainer, monitor: list[Utt]) -> None:
    """One progress line per kind of clip: WER for speech, how many came back empty for non-speech."""
    hyps = [h for i in range(0, len(monitor), 16) for h in trainer.greedy(monitor[i:i + 16])]
    for kind in dict.fromkeys(u.kind for u in monitor):
        pairs = [(u, h) for u, h in zip(monitor, hyps, strict=True) if u.kind == kind]
        if kind == "nonspeech":
            print(f"  val {kind}: empty {sum(not h for _, h in pairs)}/{len(pairs)}", flush=True)
        else:
            u, h = pairs[0]
            print(f"  val {kind} WER {100 * wer([u.text for u, _ in pairs], [h for _, h in pairs]):.2f}% on "
                  f"{len(pairs)} clips; e.g. {u.text[:60]!r} -> {h[:60]!r}", flush=True)


def _cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The options that differ from their defaults, as command-line text."""
    def text(v: object) -> str:
        return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)

    return [f"--{k.replace('_', '-')}" + ("" if v is True else f" {text(v)}") for k, v in vars(args).items()
            if v != parser.get_default(k)]


def voice_mix(train: list[Utt]) -> str:
    """How many espeak-ng voices (accent + variant) the clips use, and from how many accents and variants."""
    voices = {u.voice for u in train if u.voice}
    accents = {v.split("+")[0] for v in voices}
    variants = {v.split("+")[1] if "+" in v else "" for v in voices}
    return f"{len(voices)} espeak-ng voices ({len(accents)} English accents x {len(variants)} variants)"


def write_card(out: Path, dims: dict[str, int], n_params: int, vocab: int, train: list[Utt], hours: float,
               run: str, dtype: str, speeds: tuple[float, float] = (0.9, 1.1),
               warp: tuple[float, float] = (1.0, 1.0)) -> None:
    """The model card: what the model is, how it was made, and what it cannot do."""
    card = out / "README.md"
    warped = "" if warp == (1.0, 1.0) else f"frequency warp of the log-mel {warp[0]:g}-{warp[1]:g} (drawn apart), "
    kinds = Counter(u.kind for u in train)
    seconds = Counter()
    for u in train:
        seconds[u.kind] += len(u.wave) / SR
    mix = ", ".join(f"{kinds[k]} {label} ({seconds[k] / 3600:.1f} h)" for k, label in (
        ("sentence", "single sentences"), ("multi", "runs of several sentences"),
        ("words", "random word runs"), ("nonspeech", "clips without speech")) if kinds[k])
    evaluation = "Not measured yet: run `scripts/eval_demo_model.py --update-card`."
    if card.exists() and "<!-- eval:start -->" in card.read_text():
        evaluation = card.read_text().split("<!-- eval:start -->")[1].split("<!-- eval:end -->")[0].strip()
    enc = ", ".join(f"{k} {dims[k]}" for k in ("d_model", "encoder_layers", "encoder_attention_heads",
                                                "encoder_ffn_dim", "downsample_hidden_size"))
    dec = ", ".join(f"{k} {dims[k]}" for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                "num_attention_heads", "num_key_value_heads", "head_dim"))
    card.write_text(f"""# qasr-demo-en

A toy English speech recogniser with the exact Qwen3-ASR architecture ({n_params / 1e6:.1f} M parameters),
trained with qasr's own model code so that `make demo` and the end-to-end tests recognise
real words offline. It is **not** Qwen3-ASR: it knows only the small grammar below and only synthetic voices.

```python
from qasr import ASR
asr = ASR.from_pretrained("models/qasr-demo-en")
print(asr.transcribe("examples/meeting.flac")[0].text)
```

## Files

The original Qwen3-ASR release layout: `config.json` (`thinker_config`), `generation_config.json`,
`preprocessor_config.json`, `vocab.json` + `merges.txt` + `tokenizer_config.json` (byte-level BPE, {vocab}
ids including the Qwen control tokens), and `model.safetensors` with `thinker.*` keys in {dtype}.

- audio encoder: {enc}; num_mel_bins 128, n_window 50, n_window_infer 800 (as released)
- text decoder: {dec}; untied LM head

## Training data

`scripts/make_demo_data.py`: {len(train)} clips ({hours:.1f} h) of espeak-ng speech: {mix}. The
sentences come from a closed grammar of about 400 words: voice-assistant commands (alarms, timers,
reminders, calls, messages, smart-home, weather, shopping, navigation), numbers up to 999 as words, dates,
clock times, spelled codes of letters and digits, and short everyday sentences. Single sentences last
0.5-8 s; runs of several sentences (one voice, 0.15-1.2 s pauses between them) 3-30 s; random word runs
(number words, letter/digit codes, or any of the grammar's words, in groups of 1-12 separated by pauses)
1-30 s, so that the decoder writes what it hears rather than a likely sentence; clips without speech
(silence, white, pink or brown noise, mains hum, at -60 to -8 dBFS) 1-40 s, target text empty.
Voices: {voice_mix(train)}; speed 130-190 wpm, pitch 25-75; 0.05-0.8 s of
silence on both sides; random level; white, pink, brown noise or mains hum at 15-40 dB SNR (10% clean).
Text is lowercase, without punctuation, numbers spelled out. Validation sentences never occur in training
(multi-sentence validation clips are made of them), half the validation sentence clips use voices never
heard in training (the variants f5 and m7, which no training clip uses, with the accents en-us-nyc and
en-gb-x-gbcwmd), and validation word runs use only those voices at speeds outside 130-190 wpm.

## Training

`scripts/train_demo_model.py`: teacher forcing on the official prompt (empty context, the assistant
turn `language English<asr_text>{{text}}<|im_end|>`, or `language None<asr_text><|im_end|>` for clips
without speech), loss on the assistant turn only, plus two auxiliary losses on the audio embeddings whose
heads are not saved: frame-level phoneme classification against the phoneme times espeak-ng reports, and
CTC on the transcript tokens. AdamW, warm-up then cosine decay; speed perturbation
{speeds[0]:g}-{speeds[1]:g}, {warped}random gain, SpecAugment masks. {run}.

## Evaluation

<!-- eval:start -->
{evaluation}
<!-- eval:end -->

## Limits

- English only, and only the grammar's vocabulary: any other word comes out as the nearest word it knows.
- Trained and tested on espeak-ng voices only; real human speech will mostly fail.
- Output is lowercase without punctuation; numbers come out as words.
- Segments of up to 30 s are transcribed whole; longer speech was never seen in training, so longer
  audio should be cut into segments of at most 30 s at pauses first.
- Language identification is not learned: speech is always labelled English.
""")


if __name__ == "__main__":
    main()
