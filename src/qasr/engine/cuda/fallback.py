"""The CUDA pool's portable attention (where flash cannot run), by request kind, in groups of bounded size.

One padded batch of every row of a step (``padded_attention`` over all sequences) pads each sequence to
the longest query and the longest key range of the step: with a 2048-token prefill chunk after a long
context beside 512 decode rows, that is 513 x 2048 x 16k mask slots and 513 x 16k gathered keys, over
50 GB before any score. So the rows run in groups, one after another, each a small padded batch:

- single-token rows (decode rows, and one-token prefill chunks: the same computation) are sorted by
  context length and grouped so that rows x padded keys stays under ``MAX_KEY_SLOTS``; a row is padded
  only to the longest context of its own group;
- each prefill chunk runs alone against its own context, split into blocks of query rows so that
  query rows x keys stays under ``MAX_SCORES`` (a block of rows [i0, i1) of a chunk over ctx cached keys
  is the chunk [i0, i1) over ctx + i0 cached keys: the same masks, the same result).

``FallbackPlan.peak_bytes`` is what the largest group allocates (gathered queries, keys and values, their
head-expanded copies, the mask, the scores in float32, the output), computed from the shapes, so the
tests bound a step's memory on the CPU without allocating it. Every group is planned on the host once
per forward and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qasr.engine.padded_attention import PaddedPlan, padded_attention, padded_plan

MAX_KEY_SLOTS = 1 << 16  # single-token rows x padded keys per group (gathered keys and values)
MAX_SCORES = 1 << 22  # query rows x keys per prefill block (the mask; the scores per head)


@dataclass(frozen=True)
class Group:
    """One padded batch: ``rows`` are the packed query rows it computes, ``plan`` indexes them."""

    rows: torch.Tensor  # (rows,) int64
    plan: PaddedPlan
    shape: tuple[int, int, int]  # (sequences, max_q, max_k)


def group_bytes(shape: tuple[int, int, int], heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """An upper bound of what one group's padded SDPA allocates: gathered queries, keys and values, keys
    and values expanded to every head (SDPA's math path with ``enable_gqa``), the bool mask, scores and
    weights in float32, the output and its packed copy, and the index tensors."""
    s, mq, mk = shape
    return (s * mq * heads * head_dim * elem * 3  # queries gathered, output, output packed
            + 2 * s * mk * (kv_heads + heads) * head_dim * elem  # keys, values; expanded to every head
            + s * mq * mk * (1 + 2 * 4 * heads)  # mask; scores and weights per head in float32
            + 8 * (2 * s * mq + s * mk))  # q_index, out_index, k_index


@dataclass(frozen=True)
class FallbackPlan:
    rows: int  # N packed query rows
    groups: tuple[Group, ...]

    def peak_bytes(self, heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
        """The step's output plus its largest group (groups run one after another)."""
        largest = max((group_bytes(g.shape, heads, kv_heads, head_dim, elem) for g in self.groups), default=0)
        return self.rows * heads * head_dim * elem + largest


def fallback_pieces(query_lens: Sequence[int], context_lens: Sequence[int], max_key_slots: int = MAX_KEY_SLOTS,
                    max_scores: int = MAX_SCORES) -> list[list[tuple[int, int, int, int]]]:
    """The groups as lists of pieces (sequence, first query row within it, query rows, context)."""
    singles = sorted((b for b, n in enumerate(query_lens) if n == 1), key=lambda b: -context_lens[b])
    groups: list[list[tuple[int, int, int, int]]] = []
    i = 0
    while i < len(singles):  # longest first: a group's padding is its first row's keys
        take = max(1, max_key_slots // (context_lens[singles[i]] + 1))
        groups.append([(b, 0, 1, context_lens[b]) for b in singles[i:i + take]])
        i += take
    for b, n in enumerate(query_lens):
        if n == 1:
            continue
        block = max(1, min(n, max_scores // (context_lens[b] + n)))
        groups += [[(b, i0, min(block, n - i0), context_lens[b] + i0)] for i0 in range(0, n, block)]
    return groups


def fallback_plan(tables: Sequence[Sequence[int]], block_size: int, query_lens: Sequence[int],
                  context_lens: Sequence[int], device: torch.device | str = "cpu", max_key_slots: int = MAX_KEY_SLOTS,
                  max_scores: int = MAX_SCORES) -> FallbackPlan:
    """The groups of one forward; sequence b keeps its positions in the blocks ``tables[b]`` (the padded
    batches gather through them, so scattered blocks cost the fallback nothing extra)."""
    first_row = [0]
    for n in query_lens:
        first_row.append(first_row[-1] + n)
    groups = []
    for pieces in fallback_pieces(query_lens, context_lens, max_key_slots, max_scores):
        rows = [r for b, i0, n, _ in pieces for r in range(first_row[b] + i0, first_row[b] + i0 + n)]
        tabs = [tables[b] for b, _, _, _ in pieces]
        ql = [n for _, _, n, _ in pieces]
        ctx = [c for _, _, _, c in pieces]
        shape = (len(pieces), max(ql), max(c + n for n, c in zip(ql, ctx, strict=True)))
        groups.append(Group(torch.tensor(rows, dtype=torch.int64).to(device),
                            padded_plan(tabs, block_size, ql, ctx, device), shape))
    return FallbackPlan(first_row[-1], tuple(groups))


def fallback_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: FallbackPlan,
                       scale: float) -> torch.Tensor:
    """q (N, heads, hd) packed; kc / vc one layer's (tokens + 1, kv_heads, hd) slabs -> (N, heads * hd)."""
    n, heads, hd = q.shape
    out = q.new_empty(n, heads * hd)
    for g in plan.groups:
        out.index_copy_(0, g.rows, padded_attention(q.index_select(0, g.rows), kc, vc, g.plan, scale))
    return out
