"""The text side of the official streaming algorithm: the rolled-back prefix, the prompt that ends in it,
the parsed transcript."""

from __future__ import annotations

from qasr.model.prompt import ASR_TEXT_TAG, SpecialTokens, build_prompt, normalize_language, parse_asr_output
from qasr.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a cut through a character decodes to


def encode_raw(tokenizer: Tokenizer, special: SpecialTokens, text: str) -> list[int]:
    """Tokenise decoded output as the official session does: ``<asr_text>`` as its token, BPE between."""
    ids: list[int] = []
    for i, part in enumerate(text.split(ASR_TEXT_TAG)):
        if i:
            ids.append(special.asr_text)
        ids += tokenizer.encode(part)
    return ids


def rollback(tokenizer: Tokenizer, special: SpecialTokens, raw: str, drop: int, *, at_finish: bool = False) -> str:
    """The raw output minus its last ``drop`` tokens and (mid-stream) any broken character, as the official
    code does."""
    ids = encode_raw(tokenizer, special, raw)
    if at_finish:
        return tokenizer.decode(ids[: max(1, len(ids) - drop)]) if ids else ""
    k = drop
    while True:
        end = max(0, len(ids) - k)
        if end == 0:
            return ""
        prefix = tokenizer.decode(ids[:end])
        if REPLACEMENT_CHAR not in prefix:
            return prefix
        k += 1


class PromptBuilder:
    """A step's prompt: the ASR prompt for ``n`` audio tokens, its answer begun by the prefix (tokenised
    in one run with the answer's start, as the official session does)."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialTokens, context: str, language: str | None) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self.context = context
        self.language = normalize_language(language)
        forced = f"language {self.language}{ASR_TEXT_TAG}" if self.language else ""
        self._answer_start = "assistant\n" + forced
        self._tail_len = len(tokenizer.encode("assistant\n"))  # build_prompt's end, language None

    def __call__(self, n_audio_tokens: int, prefix: str) -> list[int]:
        head = build_prompt(self.tokenizer, self.special, n_audio_tokens, self.context, None)[: -self._tail_len]
        return head + encode_raw(self.tokenizer, self.special, self._answer_start + prefix)

    def parse(self, raw: str) -> tuple[str, str]:
        """(language, text) of a raw output."""
        return parse_asr_output(raw, self.language)
