"""The text side of the official streaming algorithm: the rolled-back prefix, the prompt that ends in
it, and the parsed transcript. Shared by the oracle and the incremental session, which differ only
in how they compute the audio embeddings."""

from __future__ import annotations

from qasr.model.prompt import ASR_TEXT_TAG, SpecialTokens, build_prompt, normalize_language, parse_asr_output
from qasr.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # a cut through a multi-byte character decodes to this


def encode_raw(tokenizer: Tokenizer, special: SpecialTokens, text: str) -> list[int]:
    """Tokenise decoded output the way the official session does (the tokenizer recognising added
    tokens): ``<asr_text>`` is the one added token that survives decoding, so split on it and BPE the
    runs between."""
    ids: list[int] = []
    for i, part in enumerate(text.split(ASR_TEXT_TAG)):
        if i:
            ids.append(special.asr_text)
        ids += tokenizer.encode(part)
    return ids


def rollback(tokenizer: Tokenizer, special: SpecialTokens, raw: str, drop: int, *, at_finish: bool = False) -> str:
    """The previous raw output minus its last ``drop`` tokens. Mid-stream the cut moves one token
    further left while the text ends in a broken character (U+FFFD) and may leave nothing; at finish
    the official code keeps at least one token and does not check for U+FFFD (kept as it is)."""
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
    """Prompt ids for a step: the usual ASR prompt for ``n`` audio tokens with the answer begun by
    the prefix. The official session tokenises ``template + prefix`` as one string; everything after
    the last ``<|im_start|>`` is therefore encoded as one run (with ``<asr_text>`` as its token)."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialTokens, context: str, language: str | None) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self.context = context
        self.language = normalize_language(language)
        forced = f"language {self.language}{ASR_TEXT_TAG}" if self.language else ""
        self._answer_start = "assistant\n" + forced
        self._tail_len = len(tokenizer.encode("assistant\n"))  # what build_prompt ends with, language None

    def __call__(self, n_audio_tokens: int, prefix: str) -> list[int]:
        head = build_prompt(self.tokenizer, self.special, n_audio_tokens, self.context, None)[: -self._tail_len]
        return head + encode_raw(self.tokenizer, self.special, self._answer_start + prefix)

    def parse(self, raw: str) -> tuple[str, str]:
        """(language, text) of a raw output, as the official session reads it."""
        return parse_asr_output(raw, self.language)
