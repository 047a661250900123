"""The forced aligner's languages and how a caller may name them."""

from __future__ import annotations

from qasr.model.prompt import LANGUAGE_CODES

# The eleven languages of Qwen3-ForcedAligner-0.6B (its release config lists the same).
ALIGNER_LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean", "Portuguese",
    "Russian", "Spanish",
)  # fmt: skip


def normalize_aligner_language(language: str | None, supported: tuple[str, ...] = ALIGNER_LANGUAGES) -> str | None:
    """A language name (any case) or ISO code -> its canonical name; None stays None (generic splitting).
    Raises ValueError naming the supported languages for anything else."""
    if language is None:
        return None
    key = str(language).strip().lower()
    name = LANGUAGE_CODES.get(key) or next((s for s in supported if s.lower() == key), None)
    if name is None or name not in supported:
        raise ValueError(f"language {language!r} is not supported by the forced aligner; supported: "
                         f"{', '.join(supported)}")
    return name
