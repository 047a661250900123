"""KV memory in fixed-size blocks, taken as tokens are made.

A sequence holds a block table: its position p lives at pool row ``table[p // block_size] * block_size +
p % block_size``. Free blocks go lowest id first, so a request that runs alone gets consecutive blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class BlockAllocator:
    """Hands out blocks of ``block_size`` tokens from ``num_blocks``; all or nothing per call."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap
        self._held = np.zeros(num_blocks, dtype=bool)  # catches a double free

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used(self) -> int:
        return self.used_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def alloc(self, n: int) -> list[int] | None:
        """n free blocks, lowest ids first; None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._held[out] = True
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if not self._held[b]:
                raise RuntimeError(f"KV block {b} freed twice")
            self._held[b] = False
            heapq.heappush(self._free, b)


def token_rows(table: Sequence[int], block_size: int, start: int, stop: int) -> np.ndarray:
    """Pool rows of positions [start, stop) of a sequence with this block table."""
    pos = np.arange(start, stop, dtype=np.int64)
    return np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def contiguous_start(table: Sequence[int], block_size: int, tokens: int) -> int | None:
    """The first pool row when positions [0, tokens) lie in consecutive blocks, else None."""
    n = -(-tokens // block_size)
    first = table[0]
    if all(table[i] == first + i for i in range(1, n)):
        return first * block_size
    return None
