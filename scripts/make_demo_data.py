"""Synthetic English speech for the demo model: espeak-ng over many voices, with noise and padding.

The demo model must really recognise speech, yet no recordings can be downloaded, so the data is
made here: sentences from a closed but useful grammar (commands, numbers, dates, times, spelled
codes, short everyday sentences) spoken by espeak-ng accents x voice variants at random speeds and
pitches, padded with silence, scaled, and mixed with white/pink/brown noise or mains hum at 15-40 dB
SNR. Besides single sentences the mix holds the kinds of input a 30 s segment of real audio brings:
several sentences in a row with natural pauses (up to 30 s), random orders of the grammar's own words
(number-word runs, letter/digit codes, any words; 1-30 s) so the decoder cannot lean on memorised
sentences, and long stretches without speech (silence, noise, hum; 1-40 s) whose target text is empty.

The split is by sentence AND by voice: validation sentences never occur in training, and half of
the validation clips use voices (accent + variant combinations whose variants are never trained on,
with any accent) so the measured WER says something about unseen speakers. Validation word runs use
held-out voices AND speeds outside the training range only. Multi-sentence clips are built from their
split's sentences. The sentences that
tests/e2e/test_demo_model.py speaks are excluded from both sets.

    .venv/bin/python scripts/make_demo_data.py --out data/demo --jobs 2

Writes 16 kHz mono FLAC files and ``train.jsonl`` / ``val.jsonl`` (path relative to the manifest,
kind, text, voice, speed, pitch, snr, noise, duration, and the phonemes espeak-ng spoke with their times in
the clip). espeak-ng runs through its C library (the CLI cannot report phoneme times). Same seed, same data.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16000

# Accents x variants of the first recipe (until 2026-12): two accents and the variants f5 and m7 held out of
# training. The aligner's data (make_aligner_data.py) still uses these, as its bundled model was made with them.
# "en" is British English (the CLI's "-v en-gb" resolves to it; the library wants the file name).
FIRST_ACCENTS = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan")
FIRST_VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m6", "m8", "f1", "f2", "f3", "f4", "klatt", "klatt2", "klatt3",
                  "klatt4", "adam", "linda", "steph", "steph2", "steph3", "Alex", "Alicia", "Andrea", "Andy", "Annie",
                  "Denis", "Gene", "Henrique", "Hugo", "Jacky", "Lee", "Marco", "Michael", "Mike", "Storm", "aunty",
                  "belinda", "benjamin", "boris", "caleb", "david", "ed", "edward", "iven", "john", "max", "michel",
                  "norbert", "paul", "pedro", "quincy", "rob", "robert", "sandro", "shelby", "travis", "victor", "zac")
# The ASR demo data trains every English accent espeak-ng has: a user of the demo picks any of them, and the
# accent the first recipe held out that it could not hear (West Midlands) gave 32-57% WER on random word runs
# while all the others stayed under 6%. More variants, whispered and creaky ones among them, for the same
# reason. Validation still holds out the variants f5 and m7 (never trained with any accent) and the speeds
# outside TRAIN_SPEEDS: every held-out voice is a voice the model never heard, though not an accent.
TRAIN_ACCENTS = FIRST_ACCENTS + ("en-us-nyc", "en-gb-x-gbcwmd")
TRAIN_VARIANTS = FIRST_VARIANTS + ("whisper", "whisperf", "croak", "klatt5", "klatt6", "grandma", "grandpa", "anika",
                                   "announcer", "antonio", "Diogo", "Mario", "Nguyen", "edward2", "gustave", "iven2",
                                   "iven3", "marcelo", "miguel", "pablo")
HELD_OUT_VOICES = ("en-us-nyc+f5", "en-gb-x-gbcwmd+m7", "en-us-nyc+m7", "en-gb-x-gbcwmd+f5")
TRAIN_SPEEDS = (130, 190)  # words per minute; held-out speeds lie outside, e.g. 115-128 and 192-205
HELD_OUT_SPEEDS = tuple(range(115, 129)) + tuple(range(192, 206))
MAX_SPEECH_SECONDS = 30.0  # the application cuts long audio into segments of at most 30 s

# Spoken by tests/e2e/test_demo_model.py: grammar-conforming, never in the training or validation data.
TEST_SENTENCES = (
    "set an alarm for six forty five",
    "call anna on the ninth of july",
    "the code is k four z nine",
    "turn off the lights in the bedroom",
    "remind me to buy milk tomorrow morning",
    "what is the weather like in paris on friday",
    "book a table for three people at eight thirty",
    "it costs twelve dollars and fifty cents",
)

# ---- grammar -------------------------------------------------------------------------------------

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
       "sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
            "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()
MONTHS = "january february march april may june july august september october november december".split()
WEEKDAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
LETTERS = list("bcdefghijklmnopqrstuvwxyz")  # no "a": espeak reads it as the article
CONTACTS = ("mom", "dad", "anna", "john", "sarah", "david", "emma", "peter", "lisa", "michael", "grandma",
            "the doctor", "the office", "my brother", "my sister", "the school", "tom", "kate")
CITIES = ("london", "paris", "berlin", "tokyo", "madrid", "rome", "new york", "chicago", "boston", "sydney",
          "dublin", "toronto", "vienna", "oslo", "lisbon", "seattle")
ROOMS = ("kitchen", "bedroom", "living room", "bathroom", "office", "garage", "hallway", "garden")
DEVICES = ("lights", "heating", "fan", "radio", "television", "oven", "music", "air conditioning", "lamp")
ITEMS = ("milk", "bread", "eggs", "apples", "coffee", "rice", "cheese", "butter", "tea", "oranges", "water",
         "sugar", "tomatoes", "potatoes", "chicken", "fish", "bananas", "juice")
TASKS = ("buy milk", "call mom", "water the plants", "take the medicine", "pay the rent", "walk the dog",
         "send the report", "book the tickets", "pick up the kids", "clean the kitchen", "check the email",
         "feed the cat", "go to the bank", "charge the phone", "lock the door", "read the letter")
PLACES = ("the airport", "the station", "the hospital", "the office", "the park", "the city center",
          "the nearest gas station", "the beach", "the museum", "the library", "the hotel", "the school")
APPS = ("camera", "calendar", "settings", "music player", "map", "calculator", "browser", "photos", "clock")
GENRES = ("jazz", "rock", "classical", "pop", "country", "relaxing", "dance")
PHRASES = ("i am running late", "see you soon", "i am on my way", "call me back", "happy birthday",
           "thank you very much", "i will be home at six", "good night", "the meeting is cancelled",
           "where are you", "let us meet tomorrow", "dinner is ready")
FIXED = ("what time is it", "what day is it today", "how are you today", "stop", "cancel", "yes please",
         "no thank you", "good morning", "good evening", "turn the volume up", "turn the volume down",
         "play the next song", "stop the music", "pause", "repeat that please", "hello", "thank you",
         "what is the date today", "go back", "never mind", "read my messages", "take a picture")
SUBJECTS = ("the dog", "the cat", "my friend", "the teacher", "the little girl", "the old man", "my mother",
            "the driver", "our neighbor", "the doctor", "the children", "my father", "the bird", "the team")
VERBS = ("likes", "wants", "found", "has", "sees", "needs", "bought", "lost", "opened", "painted", "took")
ADJECTIVES = ("red", "big", "small", "old", "new", "green", "blue", "heavy", "white", "black", "yellow",
              "warm", "cold", "long", "short", "happy", "quiet")
NOUNS = ("ball", "book", "car", "house", "box", "door", "window", "table", "chair", "letter", "bag",
         "hat", "key", "cup", "bottle", "bike", "garden", "picture", "phone", "coat")
WHERE = ("in the kitchen", "at the station", "in the park", "near the river", "on the table", "at home",
         "in the garden", "at school", "under the bed", "by the window")


def number(n: int) -> str:
    """0..999 in words, American style without "and" (e.g. two hundred fifty)."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number(rest))


def small(r: random.Random, hi: int = 60) -> str:
    return number(r.randint(1, hi)) if r.random() < 0.85 else number(r.randint(1, 999))


def count(r: random.Random, unit: str, hi: int = 60) -> str:
    """A quantity with its unit, singular for one ("one minute", "twenty minutes")."""
    n = r.randint(1, hi) if r.random() < 0.85 else r.randint(1, 999)
    return f"{number(n)} {unit}" + ("" if n == 1 else "s")


def clock(r: random.Random) -> str:
    h = number(r.randint(1, 12))
    m = r.randint(0, 59)
    kind = r.random()
    if kind < 0.2:
        return h
    if kind < 0.3:
        return r.choice(("half past ", "quarter past ", "quarter to ")) + h
    if kind < 0.4:
        return h + r.choice((" in the morning", " in the evening", " in the afternoon"))
    if kind < 0.45:
        return r.choice(("noon", "midnight"))
    if m == 0:
        return h + " hundred" if r.random() < 0.1 else h
    return h + (" oh " + ONES[m] if m < 10 else " " + number(m))


def date(r: random.Random) -> str:
    day, month = r.choice(ORDINALS[:20] + ["twenty " + o for o in ORDINALS[:9]] + ["thirtieth", "thirty first"]), \
        r.choice(MONTHS)
    kind = r.random()
    if kind < 0.45:
        return f"the {day} of {month}"
    if kind < 0.7:
        return f"{month} {day}"
    if kind < 0.85:
        return f"{r.choice(WEEKDAYS)} the {day}"
    return r.choice(("next ", "this ", "")) + r.choice(WEEKDAYS)


def when(r: random.Random) -> str:
    k = r.random()
    if k < 0.35:
        return "at " + clock(r)
    if k < 0.6:
        return "on " + date(r)
    if k < 0.8:
        return r.choice(("tomorrow", "today", "tonight", "tomorrow morning", "this evening", "next week"))
    return "on " + date(r) + " at " + clock(r)


def code(r: random.Random) -> str:
    return " ".join(r.choice(LETTERS) if r.random() < 0.55 else ONES[r.randint(0, 9)] for _ in range(r.randint(2, 6)))


def digits(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(ONES[r.randint(0, 9)] for _ in range(r.randint(lo, hi)))


def sentence(r: random.Random) -> str:
    """One random sentence; the templates are weighted by how often such requests come up."""
    c = r.choice
    templates = [
        lambda: f"set an alarm for {clock(r)}" + c(("", " tomorrow", " on " + c(WEEKDAYS), " on " + date(r))),
        lambda: f"wake me up at {clock(r)}" + c(("", " tomorrow", " on " + c(WEEKDAYS))),
        lambda: f"set a timer for {count(r, c(('minute', 'second', 'hour')))}",
        lambda: f"remind me to {c(TASKS)} {when(r)}",
        lambda: f"call {c(CONTACTS)}" + c(("", " " + when(r), " on " + date(r))),
        lambda: f"send a message to {c(CONTACTS)} saying {c(PHRASES)}",
        lambda: f"the code is {code(r)}",
        lambda: f"my number is {digits(r, 4, 7)}",
        lambda: f"my initials are {c(LETTERS)} {c(LETTERS)}",
        lambda: f"turn {c(('on', 'off'))} the {c(DEVICES)}" + c(("", f" in the {c(ROOMS)}")),
        lambda: f"set the temperature to {number(r.randint(10, 30))} degrees",
        lambda: f"what is the weather like in {c(CITIES)}" + c(("", " today", " tomorrow", f" on {c(WEEKDAYS)}")),
        lambda: f"add {c(ITEMS)} to the shopping list",
        lambda: f"add {small(r, 12)} {c(ITEMS)} and {c(ITEMS)} to my list",
        lambda: f"play some {c(GENRES)} music",
        lambda: f"how much is {small(r, 20)} {c(('plus', 'minus', 'times'))} {small(r, 20)}",
        lambda: f"book a table for {number(r.randint(2, 12))} people {when(r)}",
        lambda: f"the meeting is on {date(r)} at {clock(r)}",
        lambda: f"i will be there in {count(r, 'minute')}",
        lambda: f"it costs {count(r, 'dollar', 99)}" + c(("", f" and {number(r.randint(2, 99))} cents")),
        lambda: f"open the {c(APPS)}",
        lambda: f"navigate to {c(PLACES)}",
        lambda: f"how far is {c(PLACES)} from here",
        lambda: f"my flight to {c(CITIES)} leaves {when(r)}",
        lambda: f"the train to {c(CITIES)} leaves from platform {number(r.randint(1, 20))}",
        lambda: f"room {number(r.randint(1, 999))} is on the {c(ORDINALS[:12])} floor",
        lambda: f"flight {c(LETTERS)} {c(LETTERS)} {number(r.randint(10, 999))} is delayed",
        lambda: f"{c(SUBJECTS)} {c(VERBS)} the {c(ADJECTIVES)} {c(NOUNS)}" + c(("", " " + c(WHERE))),
        lambda: f"please put the {c(NOUNS)} {c(WHERE)}",
        lambda: f"{c(SUBJECTS)} is {c(WHERE)}",
        lambda: c(FIXED),
        lambda: small(r, 999),
        lambda: date(r),
        lambda: clock(r),
    ]
    weights = [4, 2, 3, 4, 4, 2, 4, 2, 1, 3, 2, 2, 2, 1, 1, 2, 2, 3, 1, 2, 1, 1, 1, 2, 1, 1, 1, 4, 1, 1, 2, 1, 1, 1]
    return " ".join(r.choices(templates, weights)[0]().split())


# ---- rendering -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clip:
    path: str  # relative to the manifest
    kind: str  # "sentence", "multi" (sentences with pauses), "words" (random word runs) or "nonspeech"
    parts: tuple[str, ...]  # spoken one by one with a pause between; the text is their concatenation
    seconds: float  # length of a nonspeech clip's body; a speech clip is as long as its speech
    voice: str
    speed: int
    pitch: int
    snr: float | None  # dB of speech over noise; None for clean and for noise-only clips
    noise: str
    seed: int

    @property
    def text(self) -> str:
        return " ".join(self.parts)


class _Event(ctypes.Structure):
    """libespeak-ng's espeak_EVENT."""

    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8)]


class Espeak:
    """espeak-ng through its C library, for the audio AND the time of every phoneme it speaks.

    The command line cannot report timings. Phoneme times let training add a frame-level phoneme
    loss on the encoder, which teaches it to hear many times faster than a transcript-only loss.
    One instance per process: the library keeps global state.
    """

    _PHONEME, _SAMPLERATE = 7, 8

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1")
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                                         ctypes.POINTER(_Event))
        self._callback = callback_type(self._collect)  # keep a reference: C holds the pointer
        self.rate = self.lib.espeak_Initialize(2, 0, None, 1)  # synchronous, with phoneme events
        if self.rate <= 0:
            raise RuntimeError("espeak-ng failed to initialise")
        self.lib.espeak_SetSynthCallback(self._callback)
        self._audio: list[np.ndarray] = []
        self._phones: list[tuple[str, int]] = []

    def _collect(self, wav: ctypes.Array, n: int, events: ctypes.Array) -> int:
        if n > 0:
            self._audio.append(np.ctypeslib.as_array(wav, (n,)).copy())
        i = 0
        while events[i].type != 0:
            if events[i].type == self._PHONEME:
                self._phones.append((bytes(events[i].id).split(b"\0")[0].decode(), events[i].sample))
            i += 1
        return 0

    def synth(self, text: str, voice: str, speed: int, pitch: int) -> tuple[np.ndarray, list[list]]:
        """16 kHz float32 speech and its phonemes as [symbol, start s, end s] (silences start with "_")."""
        if self.lib.espeak_ng_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(1, speed, 0)  # espeakRATE, words per minute
        self.lib.espeak_SetParameter(3, pitch, 0)  # espeakPITCH, 0-100
        self._audio, self._phones = [], []
        data = text.encode()
        self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, 0, None, None)
        self.lib.espeak_Synchronize()
        raw = np.concatenate(self._audio).astype(np.float32) / 32768.0
        wave = soxr.resample(raw, self.rate, SAMPLE_RATE).astype(np.float32)
        starts = [min(sample, len(raw)) / self.rate for _, sample in self._phones] + [len(raw) / self.rate]
        phones = [[sym, round(starts[i], 4), round(starts[i + 1], 4)] for i, (sym, _) in enumerate(self._phones)
                  if starts[i + 1] > starts[i]]
        return wave, phones


_ESPEAK: Espeak | None = None


def espeak(text: str, voice: str, speed: int, pitch: int) -> tuple[np.ndarray, list[list]]:
    global _ESPEAK
    if _ESPEAK is None:
        _ESPEAK = Espeak()
    return _ESPEAK.synth(text, voice, speed, pitch)


def make_noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Unit-RMS noise of a colour; real microphones add hiss, rumble and hum rather than white noise only."""
    white = rng.standard_normal(n)
    if kind == "white":
        x = white
    elif kind in ("pink", "brown"):
        spec = np.fft.rfft(white)
        f = np.maximum(np.arange(len(spec)), 1.0)
        spec /= np.sqrt(f) if kind == "pink" else f
        x = np.fft.irfft(spec, n)
    else:  # mains hum with harmonics over faint hiss
        t = np.arange(n) / SAMPLE_RATE
        base = rng.choice([50.0, 60.0])
        x = sum(np.sin(2 * np.pi * base * k * t + rng.uniform(0, 6.3)) / k for k in (1, 2, 3, 5)) + 0.1 * white
    x = x - x.mean()
    return (x / (np.sqrt(np.mean(x**2)) + 1e-12)).astype(np.float32)


def speech_with_pauses(clip: Clip, rng: np.random.Generator) -> tuple[np.ndarray, list[list], str]:
    """Speak each part, joined by pauses of 0.15-1.2 s; parts past MAX_SPEECH_SECONDS are dropped.

    Returns the speech, its phonemes timed in it, and the text of the parts actually spoken (the plan
    only estimates durations, so the longest clips may lose their last part here).
    """
    pieces, phones, spoken, t = [], [], [], 0.0
    for i, part in enumerate(clip.parts):
        wave, ph = espeak(part, clip.voice, clip.speed, clip.pitch)
        pause = np.zeros(int(rng.uniform(0.15, 1.2) * SAMPLE_RATE) if i else 0, np.float32)
        if spoken and t + (len(pause) + len(wave)) / SAMPLE_RATE > MAX_SPEECH_SECONDS - 1.6:
            break  # leave room for the lead and tail silence
        t += len(pause) / SAMPLE_RATE
        phones += [[p, round(a + t, 4), round(b + t, 4)] for p, a, b in ph]
        t += len(wave) / SAMPLE_RATE
        pieces += [pause, wave]
        spoken.append(part)
    return np.concatenate(pieces), phones, " ".join(spoken)


def render(clip: Clip, root: Path) -> tuple[float, list[list], str]:
    """Write one clip; return its duration in seconds, its phonemes timed in the clip and its text."""
    rng = np.random.default_rng(clip.seed)
    speech, phones, text = speech_with_pauses(clip, rng) if clip.parts else (None, [], "")
    lead, tail = (int(rng.uniform(0.05, 0.8) * SAMPLE_RATE) for _ in range(2))
    body = speech if speech is not None else np.zeros(int(clip.seconds * SAMPLE_RATE), np.float32)
    wave = np.concatenate([np.zeros(lead, np.float32), body, np.zeros(tail, np.float32)])
    peak = 10 ** (rng.uniform(-20, -1) / 20)
    if speech is not None:
        wave *= peak / (np.abs(wave).max() + 1e-9)
        if clip.snr is not None:
            rms = np.sqrt(np.mean(speech**2)) * peak / (np.abs(speech).max() + 1e-9)
            wave += make_noise(clip.noise, len(wave), rng) * rms / 10 ** (clip.snr / 20)
    elif clip.noise != "silence":
        # Long non-speech spans every level a recording may hold, loud hiss included: the model must
        # answer "no speech" rather than invent words from it.
        level = rng.uniform(-60, -8) if clip.kind == "nonspeech" else rng.uniform(-35, -10) + 20 * np.log10(peak)
        wave += make_noise(clip.noise, len(wave), rng) * 10 ** (level / 20)
    wave += rng.standard_normal(len(wave)).astype(np.float32) * 1e-5  # a recording is never digital zero
    wave = np.clip(wave, -1.0, 1.0)
    out = root / clip.path
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, wave, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    shift = lead / SAMPLE_RATE
    return len(wave) / SAMPLE_RATE, [[p, round(a + shift, 3), round(b + shift, 3)] for p, a, b in phones], text


def render_many(clips: list[Clip], root: Path) -> list[tuple[float, list[list], str]]:
    return [render(c, root) for c in clips]


# ---- planning ------------------------------------------------------------------------------------


def unique_sentences(r: random.Random, n: int, exclude: set[str]) -> list[str]:
    seen: dict[str, None] = {}
    tries = 0
    while len(seen) < n:
        s = sentence(r)
        tries += 1
        if s not in exclude:
            seen.setdefault(s)
        if tries > 50 * n:
            raise RuntimeError(f"the grammar yields only {len(seen)} distinct sentences, {n} requested")
    return list(seen)


def words_of(texts: list[str]) -> list[str]:
    """The distinct words of some sentences, in first-seen order (deterministic)."""
    return list(dict.fromkeys(w for t in texts for w in t.split()))


def spoken_seconds(text: str, speed: int, per_word: float) -> float:
    """Rough espeak-ng duration, to plan clip lengths (render drops parts that overshoot).

    ``per_word`` is measured: about 0.8 word-times for sentences, 1.1 for word runs (letters are slow).
    """
    return 0.3 + len(text.split()) * per_word * 60 / speed


def word_run(r: random.Random, vocab: list[str], n: int) -> str:
    """n random words: number words, a letter/digit code, or any of the grammar's words.

    Random orders teach the decoder to write what it hears instead of the likeliest sentence.
    """
    kind = r.random()
    if kind < 0.4:
        numbers = ONES + TENS[2:] + ["hundred"]
        return " ".join(r.choice(numbers) if r.random() < 0.8 else ONES[r.randint(0, 9)] for _ in range(n))
    if kind < 0.65:
        return " ".join(r.choice(LETTERS) if r.random() < 0.55 else ONES[r.randint(0, 9)] for _ in range(n))
    return " ".join(r.choice(vocab) for _ in range(n))


def plan_parts(kind: str, r: random.Random, pool: list[str], vocab: list[str], speed: int,
               seconds: tuple[float, float]) -> tuple[str, ...]:
    """The parts of a multi-sentence or word-run clip of about ``seconds`` (uniform in the range) of speech."""
    goal = r.uniform(*seconds)
    parts: list[str] = []
    total = 0.0
    while not parts or total < goal:
        part = r.choice(pool) if kind == "multi" else word_run(r, vocab, r.randint(1, 12))
        parts.append(part)
        total += spoken_seconds(part, speed, 0.8 if kind == "multi" else 1.1) + 0.7
    return tuple(parts)


def clip(split: str, i: int, kind: str, parts: tuple[str, ...], voice: str, speed: int, r: random.Random,
         seconds: float = 0.0) -> Clip:
    """One clip's recipe: noise kind and SNR drawn here (10% of speech clean; 20% of non-speech is silence)."""
    speech = bool(parts)
    clean = r.random() < 0.1
    noise = r.choice(("white", "pink", "brown", "hum")) if speech or r.random() < 0.8 else "silence"
    noise = "none" if speech and clean else noise
    snr = None if clean or not speech else round(r.uniform(15, 40), 1)
    return Clip(path=f"{split}/{i // 1000:02d}/{split}_{i:05d}.flac", kind=kind if speech else "nonspeech",
                parts=parts, seconds=round(seconds, 2), voice=voice if speech else "", speed=speed,
                pitch=r.randint(25, 75), snr=snr, noise=noise, seed=r.getrandbits(63))


def plan(split: str, texts: list[str], voices: list[str], silent: int, r: random.Random) -> list[Clip]:
    """Single-sentence clips plus short noise-only ones: the original mix, drawn in the original order."""
    clips = []
    for i, text in enumerate(texts + [""] * silent):
        clips.append(clip(split, i, "sentence", (text,) if text else (), voices[i % len(voices)] if text else "",
                          r.randint(*TRAIN_SPEEDS), r, seconds=0.0 if text else r.uniform(0.5, 4.0)))
    return clips


def plan_long(split: str, start: int, counts: dict[str, int], pool: list[str], vocab: list[str],
              voices: list[str], held_out: bool, r: random.Random) -> list[Clip]:
    """Multi-sentence, word-run and long non-speech clips, numbered from ``start``.

    Validation multi-sentence clips are long (20-30 s, the case that matters: a whole segment) and
    half use held-out voices; validation word runs use held-out voices and held-out speeds only.
    """
    clips = []
    for kind, n in counts.items():
        for j in range(n):
            i = start + len(clips)
            if kind == "nonspeech":
                clips.append(clip(split, i, kind, (), "", 0, r, seconds=r.uniform(1.0, 40.0)))
                continue
            unseen = held_out and (kind == "words" or j % 2 == 0)
            voice = HELD_OUT_VOICES[j % len(HELD_OUT_VOICES)] if unseen else r.choice(voices)
            speed = r.choice(HELD_OUT_SPEEDS) if held_out and kind == "words" else r.randint(*TRAIN_SPEEDS)
            lo = 24.0 if held_out and kind == "multi" else (1.0 if kind == "words" else 3.0)
            # Half the training word runs are short (1-8 s), so short number strings are not rare.
            hi = 8.0 if kind == "words" and r.random() < 0.5 and not held_out else MAX_SPEECH_SECONDS - 2
            clips.append(clip(split, i, kind, plan_parts(kind, r, pool, vocab, speed, (lo, hi)), voice, speed, r))
    return clips


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/demo"))
    # --train/--val/--seed fix the sentence split; the released model was trained on this split, so
    # changing them would put its training sentences into validation.
    ap.add_argument("--train", type=int, default=16000, help="training sentences")
    ap.add_argument("--val", type=int, default=400, help="validation sentences (one clip each)")
    ap.add_argument("--single", type=int, default=None, help="training sentences spoken alone (default: all)")
    ap.add_argument("--silent", type=float, default=0.03, help="extra short noise-only clips, as a fraction")
    ap.add_argument("--multi", type=int, default=1500, help="training clips of several sentences (3-28 s)")
    ap.add_argument("--words", type=int, default=3000, help="training clips of random word runs (1-28 s)")
    ap.add_argument("--nonspeech", type=int, default=400, help="training clips without speech (1-40 s)")
    ap.add_argument("--val-long", type=int, default=40, help="validation clips of each new kind")
    ap.add_argument("--jobs", type=int, default=2, help="espeak worker processes (keep it small)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--splits", default="train,val",
                    help="which splits to render (the plan is drawn whole either way, so val alone is the same val)")
    args = ap.parse_args()
    r = random.Random(args.seed)
    texts = unique_sentences(r, args.train + args.val, set(TEST_SENTENCES))
    r.shuffle(texts)
    val_texts, train_texts = texts[:args.val], texts[args.val:]
    train_voices = [f"{a}+{v}" if v else a for a in TRAIN_ACCENTS for v in TRAIN_VARIANTS]
    tv = [r.choice(train_voices) for _ in train_texts]
    vv = [r.choice(train_voices) if i % 2 else HELD_OUT_VOICES[(i // 2) % len(HELD_OUT_VOICES)]
          for i in range(len(val_texts))]
    single = train_texts[:args.single]
    splits = {"train": plan("train", single, tv, int(args.silent * len(single)), r),
              "val": plan("val", val_texts, vv, max(8, int(args.silent * len(val_texts))), r)}
    # The new kinds are drawn after the original ones, so the sentence split above stays as it was.
    vocab = words_of(train_texts)
    splits["train"] += plan_long("train", len(splits["train"]), dict(multi=args.multi, words=args.words,
                                 nonspeech=args.nonspeech), train_texts, vocab, train_voices, False, r)
    splits["val"] += plan_long("val", len(splits["val"]), dict(multi=args.val_long, words=args.val_long,
                               nonspeech=args.val_long), val_texts, vocab, train_voices, True, r)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    for name, clips in splits.items():
        if name not in args.splits.split(","):
            continue
        parts = [clips[i::max(1, args.jobs * 4)] for i in range(max(1, args.jobs * 4))]
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = dict(zip((c.path for p in parts for c in p),
                            (d for ds in pool.map(render_many, parts, [args.out] * len(parts)) for d in ds),
                            strict=True))
        with open(args.out / f"{name}.jsonl", "w") as f:
            for c in clips:
                duration, phones, text = done[c.path]
                row = {k: v for k, v in asdict(c).items() if k not in ("parts", "seconds")}
                row.update(text=text, duration=round(duration, 3), phones=phones)
                f.write(json.dumps(row) + "\n")
        hours = sum(d for d, _, _ in done.values()) / 3600
        print(f"{name}: {len(clips)} clips, {hours:.2f} h of audio ({time.time() - start:.0f} s so far)")


if __name__ == "__main__":
    main()
