"""Random checkpoints that "speak": the LM head's rows of all but some tokens zeroed, so greedy decoding never
picks EOS and makes text of those tokens (a plain random head's ids mostly decode to nothing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qasr.model.tokenizer import Tokenizer
from qasr.testing.checkpoint import make_tiny_checkpoint


def word_ids(model_dir: Path) -> list[int]:
    """The tokenizer's whole-word tokens that encode back to themselves (" the", ...), in id order."""
    tok = Tokenizer.from_dir(model_dir)
    vocab = json.loads((Path(model_dir) / "vocab.json").read_text(encoding="utf-8"))
    return sorted(i for s, i in vocab.items() if s.startswith("\u0120") and s[1:].isascii() and s[1:].isalpha()
                  and tok.encode(tok.decode([i])) == [i])


def speaking_checkpoint(path: Path, dims: dict[str, int], transcript: str = "words") -> Path:
    """A seeded random "-hf" bf16 checkpoint at ``dims`` (built once) whose greedy text is ``words`` (whole-word
    tokens, one a step), ``empty`` (ids that decode to nothing; needs a larger ``vocab_size``) or ``steady``
    (``words``, each next word following from the one before rather than the audio, as a trained model's
    mostly do: see docs/log's testing-steady-speaking-checkpoint entry)."""
    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    if transcript not in ("words", "empty", "steady"):
        raise ValueError(f"unknown transcript {transcript!r} (words, empty or steady)")
    print(f"building a random checkpoint that speaks {transcript} in {path} ...", flush=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(tmp, layout="hf", seed=0, dtype=torch.bfloat16, std=0.02, **dims)
    state = load_file(str(tmp / "model.safetensors"))
    head = state["lm_head.weight"]
    if transcript == "words":
        kept = word_ids(tmp)
    elif transcript == "steady":
        kept = word_ids(tmp)
        # embeddings that outweigh what the layers add: each next word follows from the token before it
        embed = next(k for k in state if k.endswith("embed_tokens.weight"))
        state[embed] *= 2000
    else:
        specials = json.loads((tmp / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        kept = list(range(max(map(int, specials)) + 1, head.shape[0]))
        if not kept:
            shutil.rmtree(tmp)
            raise ValueError(f"transcript 'empty' needs ids beyond the tokenizer's {head.shape[0]}: give dims a "
                             "larger vocab_size")
        assert Tokenizer.from_dir(tmp).decode(kept[:50] + kept[-50:]) == ""
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[kept] = True
    head[~keep] = 0
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "HEAD.txt").write_text(f"LM head rows kept (all others zero): {len(kept)} ({transcript})\n")
    tmp.rename(path)
    return path
