"""Synthetic English speech with true word times, for the demo forced aligner.

espeak-ng speaks the demo grammar's sentences (scripts/make_demo_data.py) through its C library, which
reports a WORD event with the sample where each word starts. A word's span is taken from its event to
the next word's event (or the end of the speech), then trimmed to the audible part: 5 ms frames of the
clean synthetic speech quieter than -40 dB below its loudest frame are cut from both edges. So a word's
start is where its sound starts (a stop's silent closure and the pauses between sentences are not part
of any word) and its end is where its sound stops. Times are measured on the clean speech, before noise
is mixed in, so they are exact whatever the SNR.

Clips: single sentences (0.5-10 s), runs of several sentences of one voice with 0.1-2.5 s pauses
(3-30 s), and random word runs (number words, letter/digit codes, any grammar word; 1-30 s) so the
aligner must listen rather than lean on sentence patterns; 0.05-1.5 s of silence before and after,
random level, white/pink/brown noise or mains hum at 15-40 dB SNR (10% clean) as in the ASR data.
No clip is longer than 30 s (the aligner's 400 classes x 80 ms span 32 s).

The held-out split follows the ASR data's: the sentence split is drawn exactly as make_demo_data.py
draws it (same seed), so validation sentences were heard neither by the ASR demo model (which the
aligner starts from) nor by the aligner; half the validation sentence and multi-sentence clips and all
validation word runs use voices from accents and variants never trained on (HELD_OUT_VOICES), word runs
at speeds outside the training range. The sentences tests/e2e/test_demo_aligner.py speaks are excluded.

    .venv/bin/python scripts/make_aligner_data.py --out data/aligner

Writes 16 kHz mono FLAC files and ``train.jsonl`` / ``val.jsonl`` (path relative to the manifest, kind,
text, voice, speed, pitch, snr, noise, duration, and ``words``: [word, start s, end s] in the clip).
One process (the library keeps global state); same seed, same data.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_data import (  # noqa: E402 - the grammar, voices and noise of the ASR demo data
    FIRST_ACCENTS,
    FIRST_VARIANTS,
    HELD_OUT_SPEEDS,
    HELD_OUT_VOICES,
    TEST_SENTENCES,
    TRAIN_SPEEDS,
    _Event,
    make_noise,
    unique_sentences,
    word_run,
    words_of,
)

SAMPLE_RATE = 16000
MAX_CLIP_SECONDS = 30.0
TRIM_DB = -40.0  # frames this far below the loudest 5 ms frame are silence when trimming word edges
FRAME_S = 0.005

# Spoken by tests/e2e/test_demo_aligner.py with voices never trained on; kept out of all the data.
ALIGNER_TEST_SENTENCES = (
    "remind me to feed the cat on friday at seven",
    "the code is b seven x two",
    "turn on the lamp in the hallway",
    "my flight to dublin leaves tomorrow morning",
)


# ---- espeak-ng with word times --------------------------------------------------------------------


class WordSpeaker:
    """espeak-ng's C library: speech plus the sample where each word starts (its WORD events).

    espeak-ng joins a few word pairs into one word event ("on the", "in the" in this grammar); such a
    group is split at the phoneme events, giving each later word as many of the group's phonemes as
    espeak-ng speaks for it alone. One instance per process: the library keeps global state."""

    _WORD, _PHONEME = 1, 7

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1")
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                                         ctypes.POINTER(_Event))
        self._callback = callback_type(self._collect)  # keep a reference: C holds the pointer
        self.rate = self.lib.espeak_Initialize(2, 0, None, 1)  # synchronous, with phoneme events
        if self.rate <= 0:
            raise RuntimeError("espeak-ng failed to initialise")
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self._audio: list[np.ndarray] = []
        self._words: dict[int, int] = {}  # 1-based character position of a word in the text -> sample
        self._phones: list[tuple[int, str, int]] = []  # (its word's position, symbol, sample)
        self._counts: dict[tuple[str, str], int] = {}

    def _collect(self, wav: ctypes.Array, n: int, events: ctypes.Array) -> int:
        if n > 0:
            self._audio.append(np.ctypeslib.as_array(wav, (n,)).copy())
        i = 0
        while events[i].type != 0:
            e = events[i]
            if e.type == self._WORD:
                self._words.setdefault(e.text_position, e.sample)
            elif e.type == self._PHONEME:
                self._phones.append((e.text_position, bytes(e.id).split(b"\0")[0].decode(), e.sample))
            i += 1
        return 0

    def _phoneme_count(self, word: str, voice: str) -> int:
        """How many phonemes espeak-ng speaks for ``word`` alone (current voice)."""
        key = (word, voice)
        if key not in self._counts:
            text = ctypes.c_char_p(word.encode())
            out = self.lib.espeak_TextToPhonemes(ctypes.byref(text), 0, ord("|") << 8)  # "|" between phonemes
            self._counts[key] = len([p for p in out.decode().replace(" ", "|").split("|") if p])
        return self._counts[key]

    def speak(self, text: str, voice: str, speed: int, pitch: int) -> tuple[np.ndarray, list[list]]:
        """16 kHz float32 speech of ``text`` (lowercase words separated by single spaces) and its words as
        [word, start s, end s], trimmed to their audible part. Raises ValueError when espeak-ng's words
        cannot be matched to the text's words."""
        if self.lib.espeak_ng_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(1, speed, 0)  # espeakRATE, words per minute
        self.lib.espeak_SetParameter(3, pitch, 0)  # espeakPITCH, 0-100
        self._audio, self._words, self._phones = [], {}, []
        data = text.encode()
        self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, 0, None, None)
        self.lib.espeak_Synchronize()
        raw = np.concatenate(self._audio).astype(np.float32) / 32768.0
        words = text.split()
        starts = [len(" ".join(words[:i])) + (1 if i else 0) + 1 for i in range(len(words))]  # 1-based
        if starts[0] not in self._words:
            raise ValueError(f"espeak-ng reported no first word: {text!r}")
        samples: list[int] = []
        i = 0
        while i < len(words):
            j = i + 1
            while j < len(words) and starts[j] not in self._words:
                j += 1  # words i+1..j-1 were joined to word i
            samples.append(self._words[starts[i]])
            if j - i > 1:
                # pauses ("_...") and the linking glide after a vowel (";") are not a word's own phonemes
                phones = [s for pos, sym, s in self._phones if pos == starts[i] and sym[0] not in "_;"]
                counts = [self._phoneme_count(w, voice) for w in words[i:j]]
                if sum(counts) != len(phones):
                    raise ValueError(f"cannot split {' '.join(words[i:j])!r}: {len(phones)} phonemes, {counts}")
                samples += [phones[k] for k in np.cumsum(counts[:-1])]
            i = j
        bounds = [min(s, len(raw)) / self.rate for s in samples] + [len(raw) / self.rate]
        wave = soxr.resample(raw, self.rate, SAMPLE_RATE).astype(np.float32)
        return wave, trim_words(wave, words, bounds)


def trim_words(wave: np.ndarray, words: list[str], bounds: list[float]) -> list[list]:
    """[word, start, end] per word: word i spans bounds[i]..bounds[i + 1] minus silent frames at both edges.

    Silence is judged on the clean speech against its loudest frame; a word without an audible frame
    (never seen with espeak-ng) raises ValueError so the clip is dropped rather than mislabelled."""
    hop = int(FRAME_S * SAMPLE_RATE)
    n = len(wave) // hop
    energy = (wave[:n * hop].reshape(n, hop) ** 2).mean(1)
    loud = energy > energy.max() * 10 ** (TRIM_DB / 10)
    out = []
    for i, word in enumerate(words):
        a, b = int(round(bounds[i] / FRAME_S)), min(n, int(round(bounds[i + 1] / FRAME_S)))
        frames = np.flatnonzero(loud[a:b])
        if len(frames) == 0:
            raise ValueError(f"word {word!r} has no audible frame")
        out.append([word, round(float(a + frames[0]) * FRAME_S, 3), round(float(a + frames[-1] + 1) * FRAME_S, 3)])
    return out


_SPEAKER: WordSpeaker | None = None


def speak_words(text: str, voice: str, speed: int, pitch: int) -> tuple[np.ndarray, list[list]]:
    """Module-level access to the one WordSpeaker of this process (tests use it too)."""
    global _SPEAKER
    if _SPEAKER is None:
        _SPEAKER = WordSpeaker()
    return _SPEAKER.speak(" ".join(text.split()), voice, speed, pitch)


# ---- clips --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clip:
    path: str  # relative to the manifest
    kind: str  # "sentence", "multi" (sentences with pauses) or "words" (random word runs)
    parts: tuple[str, ...]  # spoken one by one with a pause between
    voice: str
    speed: int
    pitch: int
    snr: float | None  # dB of speech over noise; None for clean clips
    noise: str
    seed: int


def render(clip: Clip, root: Path) -> dict | None:
    """Write one clip; return its manifest row (None when espeak's words did not match the text)."""
    rng = np.random.default_rng(clip.seed)
    lead = rng.uniform(0.05, 1.5)
    pieces, words, spoken = [np.zeros(int(lead * SAMPLE_RATE), np.float32)], [], []
    t = lead
    for i, part in enumerate(clip.parts):
        try:
            wave, timed = speak_words(part, clip.voice, clip.speed, clip.pitch)
        except ValueError:
            return None
        pause = rng.uniform(0.1, 2.5) if i else 0.0
        if spoken and t + pause + len(wave) / SAMPLE_RATE > MAX_CLIP_SECONDS - 0.1:
            break  # the plan only estimates durations: drop parts that would overshoot
        t += pause
        words += [[w, round(a + t, 3), round(b + t, 3)] for w, a, b in timed]
        pieces += [np.zeros(int(pause * SAMPLE_RATE), np.float32), wave]
        t += len(wave) / SAMPLE_RATE
        spoken.append(part)
    tail = min(rng.uniform(0.05, 1.5), MAX_CLIP_SECONDS - t)
    speech = np.concatenate(pieces)
    wave = np.concatenate([speech, np.zeros(int(tail * SAMPLE_RATE), np.float32)])
    if len(wave) / SAMPLE_RATE > MAX_CLIP_SECONDS:  # a single part longer than 30 s: never planned
        return None
    peak = 10 ** (rng.uniform(-20, -1) / 20)
    scale = peak / (np.abs(wave).max() + 1e-9)
    wave *= scale
    if clip.snr is not None:
        voiced = speech[np.abs(speech) > 1e-4]
        rms = np.sqrt(np.mean(voiced**2)) * scale
        wave += make_noise(clip.noise, len(wave), rng) * rms / 10 ** (clip.snr / 20)
    wave += rng.standard_normal(len(wave)).astype(np.float32) * 1e-5  # a recording is never digital zero
    out = root / clip.path
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, np.clip(wave, -1.0, 1.0), SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    row = {k: v for k, v in asdict(clip).items() if k != "parts"}
    row.update(text=" ".join(spoken), duration=round(len(wave) / SAMPLE_RATE, 3), words=words)
    return row


def make_clip(split: str, i: int, kind: str, parts: tuple[str, ...], voice: str, speed: int,
              r: random.Random) -> Clip:
    clean = r.random() < 0.1
    return Clip(path=f"{split}/{i // 1000:02d}/{split}_{i:05d}.flac", kind=kind, parts=parts, voice=voice,
                speed=speed, pitch=r.randint(25, 75), snr=None if clean else round(r.uniform(15, 40), 1),
                noise="none" if clean else r.choice(("white", "pink", "brown", "hum")), seed=r.getrandbits(63))


def plan(split: str, counts: dict[str, int], pool: list[str], vocab: list[str], train_voices: list[str],
         held_out: bool, r: random.Random) -> list[Clip]:
    """Clips of each kind. In validation, even-numbered sentence/multi clips and all word runs use held-out
    voices (word runs also held-out speeds)."""
    clips = []
    for kind, n in counts.items():
        for j in range(n):
            unseen = held_out and (kind == "words" or j % 2 == 0)
            voice = HELD_OUT_VOICES[(j // 2) % len(HELD_OUT_VOICES)] if unseen else r.choice(train_voices)
            speed = r.choice(HELD_OUT_SPEEDS) if held_out and kind == "words" else r.randint(*TRAIN_SPEEDS)
            if kind == "sentence":
                parts: tuple[str, ...] = (r.choice(pool),)
            else:
                # goals past 30 s are cut by render at the last part that fits: many clips near 30 s
                goal, total, chosen = r.uniform(3.0 if kind == "multi" else 1.0, 36.0), 0.0, []
                while not chosen or total < goal:
                    part = r.choice(pool) if kind == "multi" else word_run(r, vocab, r.randint(1, 12))
                    chosen.append(part)
                    total += 0.3 + len(part.split()) * (0.8 if kind == "multi" else 1.1) * 60 / speed + 1.3
                parts = tuple(chosen)
            clips.append(make_clip(split, len(clips), kind, parts, voice, speed, r))
    return clips


def sentence_split(seed: int, n_train: int, n_val: int) -> tuple[list[str], list[str]]:
    """The ASR demo data's sentence split (make_demo_data.py's main with its defaults draws it the same
    way), minus the aligner test's sentences."""
    r = random.Random(seed)
    texts = unique_sentences(r, n_train + n_val, set(TEST_SENTENCES))
    r.shuffle(texts)
    train, val = texts[n_val:], texts[:n_val]
    return [t for t in train if t not in ALIGNER_TEST_SENTENCES], [t for t in val if t not in ALIGNER_TEST_SENTENCES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/aligner"))
    ap.add_argument("--sentences", type=int, default=6000, help="training clips of one sentence")
    ap.add_argument("--multi", type=int, default=3000, help="training clips of several sentences (3-30 s)")
    ap.add_argument("--words", type=int, default=3000, help="training clips of random word runs (1-30 s)")
    ap.add_argument("--val", type=int, default=200, help="validation clips of one sentence")
    ap.add_argument("--val-long", type=int, default=40, help="validation clips of each long kind")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    # The ASR demo data's split: seed 1234, 16000 training and 400 validation sentences.
    train_texts, val_texts = sentence_split(1234, 16000, 400)
    r = random.Random(args.seed)
    # The bundled aligner was made with the first recipe's voices (two accents held out), so these stay.
    train_voices = [f"{a}+{v}" if v else a for a in FIRST_ACCENTS for v in FIRST_VARIANTS]
    vocab = words_of(train_texts)
    splits = {
        "train": plan("train", dict(sentence=args.sentences, multi=args.multi, words=args.words), train_texts,
                      vocab, train_voices, False, r),
        "val": plan("val", dict(sentence=args.val, multi=args.val_long, words=args.val_long), val_texts,
                    vocab, train_voices, True, r),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    for name, clips in splits.items():
        rows = [render(c, args.out) for c in clips]
        kept = [row for row in rows if row is not None]
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        hours = sum(row["duration"] for row in kept) / 3600
        print(f"{name}: {len(kept)} clips ({len(rows) - len(kept)} dropped: espeak's words did not match), "
              f"{hours:.2f} h of audio ({time.time() - start:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()
