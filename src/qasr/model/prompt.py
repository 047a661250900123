"""The chat prompt, built id by id (a control-token string in ``context`` stays plain text), and the
parser of the model's raw output. No token id is hard-coded."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qasr.model.tokenizer import Tokenizer

SUPPORTED_LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese",
    "Indonesian", "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish",
    "Hindi", "Malay", "Dutch", "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino",
    "Persian", "Greek", "Romanian", "Hungarian", "Macedonian",
)  # fmt: skip
_ISO_CODES: tuple[str, ...] = (
    "zh", "en", "yue", "ar", "de", "fr", "es", "pt", "id", "it", "ko", "ru", "th", "vi", "ja",
    "tr", "hi", "ms", "nl", "sv", "da", "fi", "pl", "cs", "fil", "fa", "el", "ro", "hu", "mk",
)  # fmt: skip
LANGUAGE_CODES: dict[str, str] = dict(zip(_ISO_CODES, SUPPORTED_LANGUAGES, strict=True))
_BY_LOWER_NAME = {name.lower(): name for name in SUPPORTED_LANGUAGES}

ASR_TEXT_TAG = "<asr_text>"
_LANGUAGE_PREFIX = "language "


def normalize_language(lang: str | None) -> str | None:
    """A language name (any case) or ISO code -> the canonical name the prompt writes; None/blank: detect."""
    if lang is None or not lang.strip():
        return None
    key = lang.strip().lower()
    if key in LANGUAGE_CODES:
        return LANGUAGE_CODES[key]
    if key in _BY_LOWER_NAME:
        return _BY_LOWER_NAME[key]
    raise ValueError(f"unsupported language {lang!r}; supported: {', '.join(SUPPORTED_LANGUAGES)}")


@dataclass(frozen=True)
class SpecialTokens:
    """The control tokens' ids."""

    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    audio_pad: int
    asr_text: int
    endoftext: int

    @classmethod
    def resolve(
        cls,
        tokenizer: Tokenizer,
        audio_token_id: int,
        audio_start_token_id: int | None = None,
        audio_end_token_id: int | None = None,
    ) -> SpecialTokens:

        def lookup(token: str, configured: int | None = None) -> int:
            if configured is not None:
                return configured
            idx = tokenizer.token_to_id(token)
            if idx is None:
                raise ValueError(f"tokenizer has no {token!r} token")
            return idx

        return cls(
            im_start=lookup("<|im_start|>"),
            im_end=lookup("<|im_end|>"),
            audio_start=lookup("<|audio_start|>", audio_start_token_id),
            audio_end=lookup("<|audio_end|>", audio_end_token_id),
            audio_pad=audio_token_id,
            asr_text=lookup(ASR_TEXT_TAG),
            endoftext=lookup("<|endoftext|>"),
        )


def build_prompt(
    tokenizer: Tokenizer,
    special: SpecialTokens,
    n_audio_tokens: int,
    context: str = "",
    language: str | None = None,
) -> list[int]:
    """The generation prompt's ids for one utterance: the chat template with ``context`` as the system
    turn, ``n_audio_tokens`` placeholders, and ``language {Name}<asr_text>`` when a language is forced."""
    if n_audio_tokens < 0:
        raise ValueError(f"n_audio_tokens must be >= 0, got {n_audio_tokens}")
    name = normalize_language(language)
    enc = tokenizer.encode
    s = special
    ids = [s.im_start, *enc("system\n" + context), s.im_end, *enc("\n")]
    ids += [s.im_start, *enc("user\n"), s.audio_start, *([s.audio_pad] * n_audio_tokens), s.audio_end]
    ids += [s.im_end, *enc("\n"), s.im_start]
    if name is None:
        ids += enc("assistant\n")
    else:
        ids += [*enc(f"assistant\n{_LANGUAGE_PREFIX}{name}"), s.asr_text]
    return ids


def fix_repetitions(text: str, threshold: int = 20, max_unit: int = 20) -> str:
    """The official post-processing of repetition loops: a run of more than ``threshold`` equal characters
    becomes one, then each unit of up to ``max_unit`` characters repeated ``threshold`` times becomes one copy."""
    if threshold < 1 or max_unit < 1:
        raise ValueError("threshold and max_unit must be >= 1")
    text = _char_run_regex(threshold).sub(r"\1", text)
    last_start = len(text) - 2 * threshold
    if last_start < 0:
        return text
    unit_run = _unit_run_regex(threshold, max_unit)
    out: list[str] = []
    pos = 0
    while (m := unit_run.search(text, pos)) is not None and m.start() <= last_start:
        out += [text[pos : m.start()], m.group(1)]
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _char_run_regex(threshold: int) -> re.Pattern[str]:
    return re.compile(rf"(.)\1{{{threshold},}}", re.DOTALL)


def _unit_run_regex(threshold: int, max_unit: int) -> re.Pattern[str]:
    return re.compile(rf"(.{{1,{max_unit}}}?)\1{{{threshold - 1},}}", re.DOTALL)


def parse_asr_output(raw: str, forced_language: str | None = None) -> tuple[str, str]:
    """``language English<asr_text>transcript`` -> ``(language, text)``; ``language None``: no speech."""
    s = (raw or "").strip()
    if not s:
        return "", ""
    s = fix_repetitions(s)
    if forced_language:
        return forced_language, s.strip()
    if ASR_TEXT_TAG not in s:
        return "", s.strip()
    meta, text = s.split(ASR_TEXT_TAG, 1)
    text = text.strip()
    if "language none" in meta.lower():
        return "", text
    language = ""
    for line in meta.splitlines():
        line = line.strip()
        if line.lower().startswith(_LANGUAGE_PREFIX):
            value = line[len(_LANGUAGE_PREFIX) :].strip()
            if value:
                language = value[:1].upper() + value[1:].lower()
            break
    return language, text


def merge_languages(languages: list[str]) -> str:
    """Per-chunk languages as one string, e.g. ``"Chinese,English"`` (empties dropped, repeats merged)."""
    merged: list[str] = []
    for lang in languages:
        lang = (lang or "").strip()
        if lang and (not merged or merged[-1] != lang):
            merged.append(lang)
    return ",".join(merged)
