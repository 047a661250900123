"""A tiny but genuine Qwen2-style byte-level BPE tokenizer in the release files, learned deterministically
(ties broken lexicographically) so the files are the same bytes on every run."""

from __future__ import annotations

import json
import os
import unicodedata
from collections import Counter
from pathlib import Path

from qasr.model.tokenizer import qwen2_pre_tokenizer

# Added tokens in id order, with their "special" flag (as in the real Qwen3-ASR release).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<|audio_pad|>", True),
    ("<asr_text>", False),
    ("<timestamp>", False),
)

_CORPUS = """\
system user assistant language English Chinese None
system\nuser\nassistant\nlanguage English language Chinese language None
language English
language Chinese
language None
language German
Chinese English Cantonese Arabic German French Spanish Portuguese Indonesian Italian Korean Russian
Thai Vietnamese Japanese Turkish Hindi Malay Dutch Swedish Danish Finnish Polish Czech Filipino
Persian Greek Romanian Hungarian Macedonian
0 1 2 3 4 5 6 7 8 9 10 20 100 2024 3.14 12:30
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
This is a test of the speech recognition system. The model transcribes audio into text.
It was the best of times, it was the worst of times; we had everything before us.
I think that we should go to the meeting, and then we can talk about the results.
She said: "Please read the transcript again." He answered, 'yes, I will do it now.'
What is your name? My name is Anna and I live in a small town near the river.
There are many people who speak more than one language in this world.
Good morning, good evening, thank you very much, see you later.
one two three four five six seven eight nine ten hundred thousand
the of and to in is that for it with as was on be at by this have from or
"""


def _byte_symbols() -> list[str]:
    """GPT-2 byte-to-unicode symbols in vocabulary order (printable bytes first, then the rest)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    keep = set(printable)
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in keep:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    order = printable + [b for b in range(256) if b not in keep]
    return [symbols[b] for b in order]


def _learn_merges(text: str, budget: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Classic BPE learning over pre-tokenised words until the vocabulary holds ``budget`` ids."""
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    pre = qwen2_pre_tokenizer()
    words: Counter[tuple[str, ...]] = Counter(
        tuple(piece) for piece, _ in pre.pre_tokenize_str(unicodedata.normalize("NFC", text))
    )
    merges: list[tuple[str, str]] = []
    while len(vocab) < budget:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        vocab.setdefault(joined, len(vocab))
        words = Counter({_apply_merge(w, best, joined): c for w, c in words.items()})
    return vocab, merges


def _apply_merge(word: tuple[str, ...], pair: tuple[str, str], joined: str) -> tuple[str, ...]:
    if len(word) < 2:
        return word
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tiny_tokenizer(dir: str | os.PathLike[str], extra_text: str = "", vocab_budget: int = 400) -> dict[str, int]:
    """Write vocab.json, merges.txt and tokenizer_config.json into ``dir``; return added-token ids."""
    if vocab_budget < 256:
        raise ValueError("vocab_budget must be at least 256 (the byte-level alphabet)")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = _learn_merges(_CORPUS + extra_text, vocab_budget)

    specials = {content: len(vocab) + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    added_decoder = {
        str(specials[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
        "audio_token": "<|audio_pad|>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 65536,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }

    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (out / "merges.txt").write_text(merges_text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return specials
