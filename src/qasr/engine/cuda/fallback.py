"""The CUDA pool's portable attention in padded groups of bounded memory: single-token rows grouped by
context under ``MAX_KEY_SLOTS`` rows x keys, each prefill chunk alone in blocks of query rows under
``MAX_SCORES`` rows x keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qasr.engine.padded_attention import PaddedPlan, padded_attention, padded_plan

MAX_KEY_SLOTS = 1 << 16
MAX_SCORES = 1 << 22


@dataclass(frozen=True)
class Group:
    """One padded batch over the packed query ``rows``."""

    rows: torch.Tensor
    plan: PaddedPlan
    shape: tuple[int, int, int]  # (sequences, max_q, max_k)


def group_bytes(shape: tuple[int, int, int], heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """An upper bound of the bytes one group's padded SDPA allocates, from its shape."""
    s, mq, mk = shape
    return (s * mq * heads * head_dim * elem * 3  # queries gathered, output, output packed
            + 2 * s * mk * (kv_heads + heads) * head_dim * elem  # keys, values; expanded to every head
            + s * mq * mk * (1 + 2 * 4 * heads)  # mask; scores and weights per head in float32
            + 8 * (2 * s * mq + s * mk))


@dataclass(frozen=True)
class FallbackPlan:
    rows: int
    groups: tuple[Group, ...]

    def peak_bytes(self, heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
        largest = max((group_bytes(g.shape, heads, kv_heads, head_dim, elem) for g in self.groups), default=0)
        return self.rows * heads * head_dim * elem + largest


def fallback_pieces(query_lens: Sequence[int], context_lens: Sequence[int], max_key_slots: int = MAX_KEY_SLOTS,
                    max_scores: int = MAX_SCORES) -> list[list[tuple[int, int, int, int]]]:
    """The groups as lists of (sequence, first query row in it, query rows, context)."""
    singles = sorted((b for b, n in enumerate(query_lens) if n == 1), key=lambda b: -context_lens[b])
    groups: list[list[tuple[int, int, int, int]]] = []
    i = 0
    while i < len(singles):  # longest first: a group pads to its first row
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
    """q (N, heads, hd); kc / vc (tokens + 1, kv_heads, hd) -> (N, heads * hd)."""
    n, heads, hd = q.shape
    out = q.new_empty(n, heads * hd)
    for g in plan.groups:
        out.index_copy_(0, g.rows, padded_attention(q.index_select(0, g.rows), kc, vc, g.plan, scale))
    return out
