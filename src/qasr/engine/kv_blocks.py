"""KV memory in fixed-size blocks, taken as tokens are made.

A sequence holds a block table: its position p lives at pool row ``table[p // block_size] * block_size +
p % block_size``. Free blocks go lowest id first, so a request that runs alone gets consecutive blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from qasr.engine.request import KVLease, Request


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


class BlockManager:
    """Who holds which KV blocks: running requests and kept prefixes (leases), on the engine thread."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.leases: dict[int, KVLease] = {}  # by id(lease), oldest first

    @property
    def lease_blocks(self) -> int:
        """Blocks held by kept prefixes (evictable)."""
        return sum(len(lease.blocks) for lease in self.leases.values())

    def missing(self, req: Request, tokens: int) -> int:
        return max(0, self.allocator.blocks_for(tokens) - len(req.blocks))

    def grow(self, req: Request, tokens: int) -> bool:
        """Blocks for positions [0, tokens); False (nothing taken) if too few are free."""
        need = self.missing(req, tokens)
        if need == 0:
            return True
        got = self.allocator.alloc(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def free(self, req: Request) -> None:
        self.allocator.free(req.blocks)
        req.blocks = []

    def keep(self, req: Request) -> KVLease:
        """A finished request's prompt blocks become a lease; the rest are freed."""
        n = self.allocator.blocks_for(len(req.prompt))
        lease = KVLease(req.blocks[:n], len(req.prompt), tuple(req.prompt))
        self.allocator.free(req.blocks[n:])
        req.blocks = []
        self.leases[id(lease)] = lease
        return lease

    def release(self, lease: KVLease) -> None:
        """Free a lease's blocks (no-op once empty)."""
        self.leases.pop(id(lease), None)
        self.allocator.free(lease.blocks)
        lease.blocks = []

    def evict_oldest(self) -> bool:
        """Free the oldest lease that holds blocks; False when none does."""
        for lease in self.leases.values():
            if lease.blocks:
                self.release(lease)
                return True
        return False

    def take_over(self, req: Request) -> None:
        """Hand a continuation its prefix's blocks and start its prefill at ``prefix_len``; if the lease
        was evicted, it prefills its whole prompt (the same bits)."""
        lease = req.kv_prefix
        assert lease is not None
        self.leases.pop(id(lease), None)
        if lease.blocks:
            n = self.allocator.blocks_for(req.prefix_len)
            req.blocks = lease.blocks[:n]
            self.allocator.free(lease.blocks[n:])
            req.prefilled = req.prefix_len
        else:
            req.prefilled = 0
        lease.blocks = []
        req.kv_prefix = None
