"""Who holds which KV blocks: running requests and kept prefixes (leases), on the engine thread."""

from __future__ import annotations

from qasr.engine.kv_blocks import BlockAllocator
from qasr.engine.request import KVLease, Request


class BlockManager:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.leases: dict[int, KVLease] = {}  # by id(lease), oldest first

    @property
    def lease_blocks(self) -> int:
        """Blocks held by kept prefixes (evictable)."""
        return sum(len(lease.blocks) for lease in self.leases.values())

    def missing(self, req: Request, tokens: int) -> int:
        """Blocks the request still lacks to hold positions [0, tokens)."""
        return max(0, self.allocator.blocks_for(tokens) - len(req.blocks))

    def grow(self, req: Request, tokens: int) -> bool:
        """Give the request the blocks it lacks for positions [0, tokens); False (nothing taken) if short."""
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
