"""Decides what each engine step does: admissions, encoder slices, prefill chunks, decode rows.

Pure bookkeeping on Request objects; no tensors are touched here.

Fairness: a 20-minute piece is encoded a few 8 s windows per step and prefilled a few chunks per step,
so no step is long; and each step serves an "express lane" (the request with the least work left: one
encoder slice of at most half the budget, one prefill chunk) besides the oldest request, before the
rest in admission order. A short request that arrives behind a long one is therefore encoded in the
next step and prefilled within the next two, while the long one keeps moving.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from qasr.engine.kv_cache import RegionAllocator
from qasr.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64  # sequences holding a KV region at once
    prefill_tokens: int = 512  # prompt tokens per step, in whole chunks (at least one chunk per step)
    prefill_chunk: int = 256  # a prompt is prefilled in pieces [0, C), [C, 2C), ... whatever shares the step
    encoder_tokens: int = 512  # encoder output tokens per step, in whole windows (at least one)
    window_tokens: int = 104  # the encoder's attention window: slices start on window boundaries


@dataclass
class StepPlan:
    encode: list[tuple[Request, int]]  # (request, audio tokens to encode now), from its encoded_tokens on
    decode: list[Request]  # one token each
    prefill: list[tuple[Request, int]]  # (request, chunk length); a request's chunks are consecutive

    @property
    def requests(self) -> list[Request]:
        """Every request this plan touches, each once, in plan order."""
        seen: dict[int, Request] = {}
        for req in [*(r for r, _ in self.encode), *self.decode, *(r for r, _ in self.prefill)]:
            seen.setdefault(id(req), req)
        return list(seen.values())

    def only(self, req: Request) -> StepPlan:
        """The part of this plan that concerns one request (to rerun it alone after a failed step)."""
        return StepPlan([(r, n) for r, n in self.encode if r is req], [r for r in self.decode if r is req],
                        [(r, n) for r, n in self.prefill if r is req])


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: RegionAllocator,
                 move_kv: Callable[[int, int, int], None] | None = None) -> None:
        """``move_kv(src, dst, n)`` copies n tokens of KV between regions (for a kept prefix that must grow)."""
        self.config = config
        self.allocator = allocator
        self.move_kv = move_kv
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted, holding a KV region, in admission order
        self._turn = False  # which of the oldest request and the express lane is served first

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def admit(self) -> list[Request]:
        """Move waiting requests into KV regions, oldest first. Returns those that can never fit.
        Cancelled waiting requests are dropped here."""
        impossible = []
        while self.waiting and len(self.active) < self.config.max_running:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                self._drop_lease(req)
                req.resolve()  # closes a token stream, if any
                continue
            if req.needs_tokens > self.allocator.capacity:
                self._drop_lease(req)
                impossible.append(self.waiting.popleft())
                continue
            if req.kv_prefix is not None:
                if not self._take_over(req):
                    break
            else:
                start = self.allocator.alloc(req.needs_tokens)
                if start is None:
                    break  # wait for a region to free up; FIFO keeps latency fair
                req.start, req.reserved = start, req.needs_tokens
            self.waiting.popleft()
            self.active.append(req)
        return impossible

    def drop_cancelled(self) -> list[Request]:
        """Take the cancelled requests out of the waiting queue wherever they stand (not only at its head),
        returning any kept KV region they were to continue to the pool; the caller resolves them."""
        dropped = [r for r in self.waiting if r.cancelled]
        if dropped:  # keep exactly the others (a request cancelled meanwhile waits for the next step's sweep)
            gone = {id(r) for r in dropped}
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
            for req in dropped:
                self._drop_lease(req)
        return dropped

    def _take_over(self, req: Request) -> bool:
        """Give a request the kept region it continues (its first ``prefilled`` positions are reused):
        in place when the region is big enough, else a region half again as large (so a growing
        session moves rarely) with the reused positions copied over. False: wait for memory."""
        lease = req.kv_prefix
        assert lease is not None
        if lease.reserved >= req.needs_tokens:
            req.start, req.reserved = lease.start, lease.reserved
        else:
            size = min(req.needs_tokens * 3 // 2, self.allocator.capacity)
            start = self.allocator.alloc(size)
            if start is None:
                size = req.needs_tokens
                start = self.allocator.alloc(size)
            if start is None:
                return False
            assert self.move_kv is not None, "kept KV prefixes need a move_kv callback"
            self.move_kv(lease.start, start, req.prefilled)
            self.allocator.free(lease.start, lease.reserved)
            req.start, req.reserved = start, size
        req.kv_prefix = None
        return True

    def _drop_lease(self, req: Request) -> None:
        if req.kv_prefix is not None:  # never admitted: its kept region goes back to the pool
            self.allocator.free(req.kv_prefix.start, req.kv_prefix.reserved)
            req.kv_prefix = None

    def retire(self, req: Request) -> None:
        """A finished request that keeps its region (keep_kv): out of the running set, region held."""
        self.active.remove(req)

    def plan(self) -> StepPlan:
        """Every step runs all decode rows plus a bounded slice of the other work, so the running
        requests advance one token per step while newcomers are encoded and prefilled a little at a
        time: a decode step streams all the weights anyway, and prefill rows riding along use the
        compute that streaming leaves idle.

        Prefill chunks lie on a fixed grid per prompt and encoder slices on the window grid, so the
        work a request sees in each call (and hence its output, with row-invariant kernels) never
        depends on its neighbours."""
        encode = self._plan_encode()
        after = {id(r): r.encoded_tokens + n for r, n in encode}  # encoded tokens once this step's slices ran
        decode = [r for r in self.active if r.prefill_done]
        prefill = self._plan_prefill(after)
        return StepPlan(encode, decode, prefill)

    def _plan_encode(self) -> list[tuple[Request, int]]:
        cfg = self.config
        lookahead = 2 * cfg.prefill_tokens  # just in time: keep little encoded-but-unprefilled audio
        wanted = [r for r in self.active if not r.encoded
                  and r.encoded_tokens - _audio_prefilled(r) < lookahead]
        budget = max(cfg.encoder_tokens, cfg.window_tokens)
        plan: list[tuple[Request, int]] = []
        for k, req in enumerate(_express_first(wanted, key=lambda r: r.audio_tokens - r.encoded_tokens)):
            cap = budget // 2 if k == 0 and len(wanted) > 1 else budget  # the express lane takes at most half
            n = self._slice(req, max(cap, cfg.window_tokens))
            if plan and n > budget:
                break
            plan.append((req, n))
            budget -= n
            if budget < cfg.window_tokens:
                break
        return plan

    def _slice(self, req: Request, budget: int) -> int:
        """Audio tokens to encode from req.encoded_tokens on: whole windows within budget (one at least)."""
        w = self.config.window_tokens
        left = req.audio_tokens - req.encoded_tokens
        return min(left, max(1, budget // w) * w)

    def _plan_prefill(self, encoded_after: dict[int, int]) -> list[tuple[Request, int]]:
        cfg = self.config
        ready = {}
        for req in self.active:
            if req.prefill_done:
                continue
            limit = req.ready_until(encoded_after.get(id(req), req.encoded_tokens))
            if limit > req.prefilled:
                ready[id(req)] = limit
        wanted = [r for r in self.active if id(r) in ready]
        prefill: list[tuple[Request, int]] = []
        budget = cfg.prefill_tokens
        express = _least(wanted, key=lambda r: len(r.prompt) - r.prefilled)
        for req in self._prefill_order(wanted, express):
            done, limit = req.prefilled, ready[id(req)]
            while done < limit:  # a request may bring several consecutive chunks
                end = min((done // cfg.prefill_chunk + 1) * cfg.prefill_chunk, len(req.prompt))
                if end > limit:
                    break  # the chunk's audio is not encoded yet: the grid stays fixed, so wait for it
                n = end - done
                if prefill and n > budget:
                    return prefill
                prefill.append((req, n))
                budget -= n
                done = end
                if req is express and len(wanted) > 1:
                    break  # the express lane gets one chunk per step
        return prefill

    def _prefill_order(self, wanted: list[Request], express: Request | None) -> list[Request]:
        """The oldest request and the express lane first, then the rest in admission order. The first
        two take turns at the front, so where the budget fits only one chunk neither starves."""
        if express is None or len(wanted) < 2:
            return wanted
        head = wanted[0]
        rest = [r for r in wanted if r is not head and r is not express]
        if express is head:
            return [head, *rest]
        self._turn = not self._turn
        return [express, head, *rest] if self._turn else [head, express, *rest]

    def finish(self, req: Request) -> None:
        self.active.remove(req)
        self.allocator.free(req.start, req.reserved)


def _least(reqs: list[Request], key) -> Request | None:  # noqa: ANN001 - a sort key
    """The request with the least work left (the express lane), None when there is none."""
    return min(reqs, key=key) if reqs else None


def _express_first(reqs: list[Request], key) -> list[Request]:  # noqa: ANN001 - a sort key
    """The request with the least work left first, then the others in admission order."""
    if len(reqs) < 2:
        return reqs
    best = _least(reqs, key)
    return [best, *(r for r in reqs if r is not best)]


def _audio_prefilled(req: Request) -> int:
    return int(req.audio_before[req.prefilled])
