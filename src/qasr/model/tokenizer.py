"""Qwen2 byte-level BPE from a checkpoint's ``tokenizer.json`` or release files, without transformers.

Decoding knows the added tokens; ``encode`` does not, so text can never inject a control token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TOKENIZER_JSON = "tokenizer.json"
_RELEASE_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = tokenizers.Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt, split on '\\n' only (byte-level symbols hold no spaces or newlines)."""
    merges: list[tuple[str, str]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: malformed merge line {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _added_tokens_from_config(config: dict) -> list[tuple[int, AddedToken]]:
    entries = config.get("added_tokens_decoder") or {}
    out: list[tuple[int, AddedToken]] = []
    for key, spec in entries.items():
        token = AddedToken(
            spec["content"],
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", False)),
            special=bool(spec.get("special", False)),
        )
        out.append((int(key), token))
    return sorted(out, key=lambda item: item[0])


def _from_release_files(directory: Path) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    vocab: dict[str, int] = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    merges = _read_merges(directory / "merges.txt")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = _added_tokens_from_config(config)

    # added tokens in the vocabulary at their ids, so add_tokens() reuses them (gaps in the range allowed)
    id_to_token = {i: t for t, i in vocab.items()}
    full_vocab = dict(vocab)
    for idx, token in added:
        existing = id_to_token.get(idx)
        if existing is not None and existing != token.content:
            raise ValueError(f"added token {token.content!r} id {idx} collides with vocab entry {existing!r}")
        full_vocab[token.content] = idx

    plain = _bpe_tokenizer(vocab, merges)
    full = _bpe_tokenizer(full_vocab, merges)
    full.add_tokens([token for _, token in added])
    for idx, token in added:
        if full.token_to_id(token.content) != idx:
            raise ValueError(f"added token {token.content!r} did not receive its configured id {idx}")
    return full, plain


def _from_tokenizer_json(path: Path) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    full = tokenizers.Tokenizer.from_str(json.dumps(raw))
    raw["added_tokens"] = []
    plain = tokenizers.Tokenizer.from_str(json.dumps(raw))
    return full, plain


class Tokenizer:

    def __init__(self, full: tokenizers.Tokenizer, plain: tokenizers.Tokenizer) -> None:
        for tok in (full, plain):
            tok.no_truncation()
            tok.no_padding()
        self._full = full
        self._plain = plain
        self._special_ids = frozenset(idx for idx, token in full.get_added_tokens_decoder().items() if token.special)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        directory = Path(path)
        if (directory / _TOKENIZER_JSON).is_file():
            return cls(*_from_tokenizer_json(directory / _TOKENIZER_JSON))
        missing = [name for name in _RELEASE_FILES if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"no tokenizer found in {directory}: looked for {_TOKENIZER_JSON} or "
                f"{' + '.join(_RELEASE_FILES)} (missing: {', '.join(missing)})"
            )
        return cls(*_from_release_files(directory))

    def encode(self, text: str) -> list[int]:
        """``text`` as plain text: added-token strings in it are not control tokens."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """No tokenization-space clean-up (Qwen sets it off)."""
        return self._full.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._full.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self._full.id_to_token(idx)

    @property
    def special_ids(self) -> frozenset[int]:
        """Added tokens flagged special (what ``decode`` skips)."""
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        return self._full.get_vocab_size(with_added_tokens=True)
