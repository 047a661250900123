"""The aligner's input: ``<|audio_start|>`` + T audio placeholders + ``<|audio_end|>``, then each unit
followed by two ``<timestamp>`` slots (its start and its end), units written without spaces. No chat
template and no system or user turn: the aligner was trained on exactly this sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qasr.model.prompt import SpecialTokens
from qasr.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class AlignerPrompt:
    ids: list[int]
    slots: list[int]  # prompt positions of the <timestamp> slots, 2 per unit, in order


def build_aligner_prompt(tokenizer: Tokenizer, special: SpecialTokens, timestamp_id: int, audio_tokens: int,
                         words: Sequence[str]) -> AlignerPrompt:
    """Each unit is BPE-encoded on its own: the <timestamp> tokens between units split the text there
    anyway, so this equals encoding the concatenated string."""
    ids = [special.audio_start, *([special.audio_pad] * audio_tokens), special.audio_end]
    slots: list[int] = []
    for word in words:
        ids.extend(tokenizer.encode(word))
        slots.extend((len(ids), len(ids) + 1))
        ids.extend((timestamp_id, timestamp_id))
    return AlignerPrompt(ids, slots)
