"""The aligner's languages and the units it times: words, one unit per CJK ideograph, morphemes for Japanese
and Korean; only letters, numbers and apostrophes are kept."""

from __future__ import annotations

import importlib
import unicodedata
from types import ModuleType

from qasr.model.prompt import LANGUAGE_CODES

# The official aligner's CJK ideograph blocks, one unit per character; the one table of ideographs.
CJK_IDEOGRAPHS: tuple[tuple[int, int], ...] = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF), (0xF900, 0xFAFF),
)  # fmt: skip


def is_cjk(char: str) -> bool:
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in CJK_IDEOGRAPHS)


def is_kept(char: str) -> bool:
    """Letters, numbers and the apostrophe ("it's")."""
    return char == "'" or unicodedata.category(char)[0] in "LN"


def clean(token: str) -> str:
    return "".join(c for c in token if is_kept(c))


ALIGNER_LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean", "Portuguese",
    "Russian", "Spanish",
)  # fmt: skip


def normalize_aligner_language(language: str | None, supported: tuple[str, ...] = ALIGNER_LANGUAGES) -> str | None:
    """A language name (any case) or ISO code -> its canonical name; None stays None; else ValueError."""
    if language is None:
        return None
    key = str(language).strip().lower()
    name = LANGUAGE_CODES.get(key) or next((s for s in supported if s.lower() == key), None)
    if name is None or name not in supported:
        raise ValueError(f"language {language!r} is not supported by the forced aligner; supported: "
                         f"{', '.join(supported)}")
    return name


def split_units(text: str, language: str | None = None) -> list[str]:
    """The units of ``text``; Japanese needs the optional ``nagisa``, Korean ``soynlp``."""
    text = text.strip()
    if language == "Japanese":
        nagisa = _optional("nagisa", "Japanese")
        return _cleaned(nagisa.tagging(text).words)
    if language == "Korean":
        tokenizer = _optional("soynlp.tokenizer", "Korean", package="soynlp")
        return _cleaned(tokenizer.LTokenizer().tokenize(text))
    units: list[str] = []
    for chunk in text.split():
        word = []
        for c in clean(chunk):
            if is_cjk(c):  # an ideograph ends the word before it
                if word:
                    units.append("".join(word))
                    word = []
                units.append(c)
            else:
                word.append(c)
        if word:
            units.append("".join(word))
    return units


def _cleaned(tokens: list[str]) -> list[str]:
    return [w for w in (clean(t) for t in tokens) if w]


def _optional(module: str, language: str, package: str | None = None) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        name = package or module
        raise ImportError(f"aligning {language} text needs the optional package {name!r}, which splits "
                          f"{language} into words: pip install {name}") from exc
