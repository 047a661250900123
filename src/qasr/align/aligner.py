"""``qasr.Aligner``: each (audio, transcript) pair one engine request, prefilled; the head runs at its
timestamp slots only."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from qasr.align.timestamps import words_from_classes
from qasr.align.units import ALIGNER_LANGUAGES, normalize_aligner_language, split_units
from qasr.audio.io import AudioSource, load_audio
from qasr.engine.engine import Engine, EngineConfig
from qasr.model.checkpoint import Checkpoint, load_checkpoint
from qasr.model.config import audio_token_count
from qasr.model.prompt import SpecialTokens
from qasr.model.tokenizer import Tokenizer
from qasr.results import Word

# shorter clips are zero-padded to this before the log-mel, as the official library does
MIN_SAMPLES = 8000


# The aligner's input, no chat template: the audio, then each unit followed by its two <timestamp> slots.
@dataclass(frozen=True)
class AlignerPrompt:
    ids: list[int]
    slots: list[int]  # prompt positions of the <timestamp> slots, 2 per unit, in order


def build_aligner_prompt(tokenizer: Tokenizer, special: SpecialTokens, timestamp_id: int, audio_tokens: int,
                         units: Sequence[str]) -> AlignerPrompt:
    ids = [special.audio_start, *([special.audio_pad] * audio_tokens), special.audio_end]
    slots: list[int] = []
    for unit in units:
        ids.extend(tokenizer.encode(unit))
        slots.extend((len(ids), len(ids) + 1))
        ids.extend((timestamp_id, timestamp_id))
    return AlignerPrompt(ids, slots)


class Aligner:
    """Word (CJK: character) timestamps for known transcripts. ``align`` takes any audio input;
    ``align_pieces`` / ``submit_pieces`` 16 kHz float32 arrays (an ASR's pieces, with their offsets)."""

    def __init__(self, checkpoint: Checkpoint, engine: Engine) -> None:
        cfg = checkpoint.config
        if not cfg.is_aligner or cfg.timestamp_token_id is None:
            raise ValueError(f"{checkpoint.path} is not a forced-aligner checkpoint (its head is an LM head, "
                             f"not a timestamp classifier)")
        self.checkpoint = checkpoint
        self.engine = engine
        self.sample_rate = checkpoint.features.sampling_rate
        self.segment_ms = cfg.timestamp_segment_time
        listed = tuple(lang for lang in cfg.support_languages if lang in ALIGNER_LANGUAGES)
        self.supported_languages: tuple[str, ...] = listed or ALIGNER_LANGUAGES
        # the head's classes end here: later times cannot be expressed
        self.max_seconds = cfg.classify_num * self.segment_ms / 1000.0  # type: ignore[operator]

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", engine_config: EngineConfig | None = None) -> Aligner:
        """A forced-aligner checkpoint (either layout); its engine starts lazily."""
        checkpoint = load_checkpoint(name_or_path, device=device, dtype=dtype)
        if not checkpoint.config.is_aligner:
            raise ValueError(f"{name_or_path} is not a forced-aligner checkpoint (it looks like an ASR model)")
        return cls(checkpoint, Engine(checkpoint, engine_config or EngineConfig()))

    def align(self, audio: AudioSource | Sequence[AudioSource], text: str | Sequence[str],
              language: str | None | Sequence[str | None], sample_rate: int | None = None) -> list[list[Word]]:
        """One word list per (audio, transcript) pair; one ``language`` applies to every pair."""
        items = _as_list(audio)
        texts = [text] if isinstance(text, str) else list(text)  # only the language is broadcast
        if len(texts) != len(items):
            raise ValueError(f"{len(texts)} transcripts for {len(items)} audio inputs; they must match 1:1")
        waves = [load_audio(item, sample_rate) for item in items]
        return self.align_pieces(waves, texts, language)

    def align_pieces(self, samples: Sequence[np.ndarray], texts: Sequence[str],
                     language: str | None | Sequence[str | None],
                     offsets: Sequence[float] | None = None) -> list[list[Word]]:
        """Times in seconds from each array's start plus its offset."""
        return [f.result() for f in self.submit_pieces(samples, texts, language, offsets)]

    async def align_pieces_async(self, samples: Sequence[np.ndarray], texts: Sequence[str],
                                 language: str | None | Sequence[str | None],
                                 offsets: Sequence[float] | None = None) -> list[list[Word]]:
        futures = self.submit_pieces(samples, texts, language, offsets)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        finally:
            for f in futures:
                f.cancel()  # stops the rest when one failed or the caller was cancelled

    def submit_pieces(self, samples: Sequence[np.ndarray], texts: Sequence[str],
                      language: str | None | Sequence[str | None],
                      offsets: Sequence[float] | None = None) -> list[Future]:
        """One Future of words per piece, all checked before any is queued; cancelling one cancels its request."""
        n = len(samples)
        if len(texts) != n:
            raise ValueError(f"{len(texts)} transcripts for {n} audio pieces; they must match 1:1")
        langs = [language] * n if language is None or isinstance(language, str) else list(language)
        if len(langs) != n:
            raise ValueError(f"{len(langs)} languages for {n} audio pieces; pass one, or one per piece")
        offs = [0.0] * n if offsets is None else [float(o) for o in offsets]
        if len(offs) != n:
            raise ValueError(f"{len(offs)} offsets for {n} audio pieces")
        prepared = [self._prepare(s, t, lang) for s, t, lang in zip(samples, texts, langs, strict=True)]
        return [self._submit(wave, units, prompt, off) for (wave, units, prompt), off in zip(prepared, offs,
                                                                                             strict=True)]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Aligner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, samples: np.ndarray, text: str,
                 language: str | None) -> tuple[np.ndarray, list[str], AlignerPrompt | None]:
        lang = normalize_aligner_language(language, self.supported_languages)
        wave = np.asarray(samples)
        if wave.ndim != 1 or not np.issubdtype(wave.dtype, np.floating):
            raise ValueError(f"audio pieces must be 1-D float arrays at {self.sample_rate} Hz, got "
                             f"{wave.dtype} {wave.shape}")
        seconds = len(wave) / self.sample_rate
        if seconds > self.max_seconds:
            raise ValueError(f"audio of {seconds:.1f} s is longer than the aligner can time "
                             f"({self.max_seconds:.0f} s: {self.checkpoint.config.classify_num} classes of "
                             f"{self.segment_ms:g} ms); split it into pieces (the official pipeline aligns "
                             f"pieces of at most 180 s)")
        wave = np.ascontiguousarray(wave, dtype=np.float32)
        if len(wave) < MIN_SAMPLES:
            wave = np.pad(wave, (0, MIN_SAMPLES - len(wave)))
        units = split_units(text, lang)
        if not units:
            return wave, units, None
        ck = self.checkpoint
        frames = len(wave) // ck.features.hop_length
        n_audio = audio_token_count(frames, ck.config.encoder.conv_chunk_frames)
        prompt = build_aligner_prompt(ck.tokenizer, ck.special, ck.config.timestamp_token_id,  # type: ignore[arg-type]
                                      n_audio, units)
        return wave, units, prompt

    def _submit(self, wave: np.ndarray, units: list[str], prompt: AlignerPrompt | None, offset: float) -> Future:
        out: Future = Future()
        if prompt is None:  # no letters or digits: nothing to align
            out.set_result([])
            return out
        inner = self.engine.submit_alignment(prompt.ids, positions=prompt.slots, waveform=wave)

        def finish(f: Future) -> None:  # on the engine thread
            if f.cancelled():
                out.cancel()
                return
            if f.exception() is not None:
                _settle(out, error=f.exception())
                return
            try:
                found = words_from_classes(units, f.result(), self.segment_ms)
                if offset:
                    found = [Word(w.text, round(w.start + offset, 3), round(w.end + offset, 3)) for w in found]
                _settle(out, found)
            except Exception as exc:  # noqa: BLE001 - hand it to the caller, never to the engine thread
                _settle(out, error=exc)

        out.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
        inner.add_done_callback(finish)
        return out


def _settle(fut: Future, result: object = None, error: BaseException | None = None) -> None:
    if fut.done():  # cancelled by the caller meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _as_list(audio: AudioSource | Sequence[AudioSource]) -> list[AudioSource]:
    if isinstance(audio, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, tuple)):
        return [audio]  # a tuple is one (array, sample_rate) input
    return list(audio)
