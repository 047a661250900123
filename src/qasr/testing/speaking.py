"""Random checkpoints that "speak": greedy decoding never picks EOS and its text is chosen in advance.

Benchmarks force equal work on both sides by running every request to its cap; a plain random head
mostly picks ids that decode to nothing, so a streamed request would send no deltas and a live session
no growing prefix, and both would cost less than real speech does. Zeroing the LM head rows of all but
some tokens (their logit is then 0, and the largest of the kept rows' random logits wins) fixes what the
text is made of.
"""

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
    """Build (once: an existing one at ``path`` is returned as it is) a seeded random "-hf" checkpoint in
    bf16 (std 0.02) at ``dims`` whose greedy text is

    * ``words``: whole-word tokens only (see word_ids): the text grows by one word per generated token and
      feeds back as the next prefix, like a transcript;
    * ``empty``: ids beyond the small test tokenizer, which decode to nothing (a stream whose transcript
      never grows, e.g. silence); ``dims`` must then hold a ``vocab_size`` larger than the tokenizer;
    * ``steady``: the ``words`` head with every token embedding 50x larger, so that each next word follows
      from the token before it rather than from the audio: the text is a fixed chain of words, and a live
      step makes again the tokens its prefix rolled back, as a trained model mostly does (the bundled demo
      model did for 193 of 193 guessed tokens over a minute of live speech), where ``words`` picks by random
      logits that flip with any change of the audio (about 1 guess in 5 came true). The work per step is
      the same; it decides how much checking those guesses (``Continuation.draft``) saves."""
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
        # token embeddings 2000x larger (std 40, against the ~3 that 28 layers of std 0.02 weights add): the residual
        # stream, and so each next word, then follows from the token before it, not from the audio
        embed = next(k for k in state if k.endswith("embed_tokens.weight"))
        state[embed] *= 2000
    else:
        specials = json.loads((tmp / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        kept = list(range(max(map(int, specials)) + 1, head.shape[0]))
        if not kept:  # every row zero would make id 0 win every step
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
