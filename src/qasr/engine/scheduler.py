"""What each engine step does: admissions, encoder slices, prefill chunks, decode rows, preemptions.
Engine thread only; the policies are in docs/engine.md."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from qasr.engine.kv_blocks import BlockManager
from qasr.engine.request import Request

DRAFT_ROWS = 8  # guesses checked per request and step


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64
    prefill_tokens: int = 512  # per step, in whole chunks (one at least)
    prefill_chunk: int = 256  # prefill grid
    encoder_tokens: int = 512  # per step, in whole windows (one at least)
    window_tokens: int = 104  # encoder slice grid


@dataclass
class StepPlan:
    encode: list[tuple[Request, int]]  # (request, audio tokens)
    decode: list[Request]
    prefill: list[tuple[Request, int]]  # (request, chunk length), in order
    live_batch_work: bool = False
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # by id(request)

    @property
    def requests(self) -> list[Request]:
        seen: dict[int, Request] = {}
        for req in [*(r for r, _ in self.encode), *self.decode, *(r for r, _ in self.prefill)]:
            seen.setdefault(id(req), req)
        return list(seen.values())

    def only(self, req: Request) -> StepPlan:
        own = {id(req): self.drafts[id(req)]} if id(req) in self.drafts else {}
        return StepPlan([(r, n) for r, n in self.encode if r is req], [r for r in self.decode if r is req],
                        [(r, n) for r, n in self.prefill if r is req], drafts=own)

    def drop(self, req: Request) -> None:
        self.encode[:] = [(r, n) for r, n in self.encode if r is not req]
        self.decode[:] = [r for r in self.decode if r is not req]
        self.prefill[:] = [(r, n) for r, n in self.prefill if r is not req]
        self.drafts.pop(id(req), None)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # in admission order
        self.encoding: list[Request] = []  # encoder-only requests
        self.preemptions = 0
        self.batch_heavy_ok = True  # batch work may ride beside live work
        self._turn = False

    def add(self, req: Request) -> None:
        (self.encoding if req.encode_only else self.waiting).append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active and not self.encoding

    def admit(self) -> list[Request]:
        """Admit waiting requests (interactive, continuations, then by group); return those that never fit."""
        impossible = []
        for req in [r for r in self.waiting if r.interactive and not r.cancelled]:
            self.waiting.remove(req)
            if req.needs_tokens > self.blocks.allocator.capacity:
                self._drop_lease(req)
                impossible.append(req)
                continue
            if req.kv_prefix is not None:
                self.blocks.take_over(req)
            self.active.append(req)
        for req in [r for r in self.waiting if r.kv_prefix is not None and r.kv_prefix.blocks and not r.cancelled]:
            if len(self.active) >= self.config.max_running:
                break
            self.waiting.remove(req)
            self.blocks.take_over(req)
            self.active.append(req)
        if not self.waiting or len(self.active) >= self.config.max_running:
            return impossible
        queues = _by_group(self.waiting)
        running = Counter(r.group_key for r in self.active if not r.interactive)
        taken: set[int] = set()
        while queues and len(self.active) < self.config.max_running:
            key = _next_group(queues, running)
            req = queues[key][0]
            if req.cancelled:
                taken.add(id(queues[key].popleft()))
                self._drop_lease(req)
                req.resolve()
            elif req.needs_tokens > self.blocks.allocator.capacity:
                taken.add(id(queues[key].popleft()))
                self._drop_lease(req)
                impossible.append(req)
            # wait for room to get back where it was, or it is preempted again at once
            elif self.active and self._room() < self.blocks.allocator.blocks_for(len(req.prompt) + len(req.replay)):
                break
            else:
                taken.add(id(queues[key].popleft()))
                if req.kv_prefix is not None:
                    self.blocks.take_over(req)
                self.active.append(req)
                running[key] += 1
            if not queues[key]:
                del queues[key]
        if taken:
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        return impossible

    def _room(self) -> int:
        """Free and evictable blocks, less what admitted prompts need and one per decode row."""
        alloc = self.blocks.allocator
        promised = sum(self.blocks.missing(r, len(r.prompt)) for r in self.active if not r.prefill_done)
        decoding = sum(r.prefill_done for r in self.active)
        return alloc.free_blocks + self.blocks.lease_blocks - promised - decoding

    def drop_cancelled(self) -> list[Request]:
        """Take cancelled requests out of the queue; the caller resolves them."""
        gone_encodes = [r for r in self.encoding if r.cancelled]
        self.encoding = [r for r in self.encoding if not r.cancelled]
        dropped = [r for r in self.waiting if r.cancelled]
        if dropped:
            gone = {id(r) for r in dropped}
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
            for req in dropped:
                self._drop_lease(req)
        return gone_encodes + dropped

    def _drop_lease(self, req: Request) -> None:
        if req.kv_prefix is not None:
            self.blocks.release(req.kv_prefix)
            req.kv_prefix = None

    def retire(self, req: Request) -> None:
        self.active.remove(req)

    def finish(self, req: Request) -> None:
        if req.encode_only:
            self.encoding.remove(req)
            return
        self.active.remove(req)
        self.blocks.free(req)
        req.audio = None

    def _reserve(self, req: Request, tokens: int, plan: StepPlan) -> bool:
        """Blocks for positions [0, tokens) of ``req``, evicting and preempting as needed; False if short."""
        while not self.blocks.grow(req, tokens):
            if self.blocks.evict_oldest():
                continue
            victims = [r for r in self.active if r.blocks and r is not req and _may_preempt(req, r)]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: (not r.interactive, r.id)), plan)  # youngest batch first
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free a running request's blocks and queue it first, to recompute."""
        self.active.remove(req)
        self.blocks.free(req)
        plan.drop(req)
        req.preempted.append("decode" if req.prefill_done else "prefill")
        if len(req.output) > len(req.replay):
            req.replay = req.output
        req.output = []
        req.prefilled = 0
        req.classes = []
        self.waiting.appendleft(req)
        self.preemptions += 1

    def plan(self) -> StepPlan:
        """The next step: every decode row plus bounded encoder and prefill work; KV blocks are taken here."""
        live = self._live()
        plan = StepPlan(self._plan_encode(live), [], [])
        after = {id(r): r.encoded_tokens + n for r, n in plan.encode}
        for req in sorted(self.active, key=lambda r: not r.interactive):
            if req in self.active and req.prefill_done and self._reserve(req, len(req.prompt) + len(req.output), plan):
                plan.decode.append(req)
        self._plan_prefill(after, plan, live)
        self._plan_drafts(plan)
        if live:
            plan.live_batch_work = (any(not r.interactive and not r.encode_only for r, _ in plan.encode)
                                    or any(not r.interactive for r, _ in plan.prefill))
        return plan

    def _plan_drafts(self, plan: StepPlan) -> None:
        for req in plan.decode:
            ahead = req.draft_ahead(min(DRAFT_ROWS, req.max_new_tokens - len(req.output) - 1))
            if ahead and self.blocks.grow(req, len(req.prompt) + len(req.output) + len(ahead)):
                plan.drafts[id(req)] = ahead

    def _live(self) -> bool:
        return bool(self.encoding) or any(r.interactive for r in self.active)

    def _plan_encode(self, live: bool) -> list[tuple[Request, int]]:
        cfg = self.config
        lookahead = 2 * cfg.prefill_tokens
        wanted = [r for r in self.active if not r.encoded
                  and r.encoded_tokens - _audio_prefilled(r) < lookahead]
        plan: list[tuple[Request, int]] = [(r, r.audio_tokens) for r in self.encoding if not r.cancelled]
        jobs = len(plan)
        budget = max(cfg.encoder_tokens - sum(n for _, n in plan), cfg.window_tokens)
        if live:
            budget = cfg.window_tokens
            if not self.batch_heavy_ok:
                wanted = [r for r in wanted if r.interactive]
        for k, req in enumerate(_express_first(wanted, key=lambda r: r.audio_tokens - r.encoded_tokens)):
            cap = budget // 2 if k == 0 and len(wanted) > 1 else budget  # the express lane
            n = self._slice(req, max(cap, cfg.window_tokens))
            if len(plan) > jobs and n > budget:
                break
            plan.append((req, n))
            budget -= n
            if budget < cfg.window_tokens:
                break
        return plan

    def _slice(self, req: Request, budget: int) -> int:
        w = self.config.window_tokens
        left = req.audio_tokens - req.encoded_tokens
        return min(left, max(1, budget // w) * w)

    def _plan_prefill(self, encoded_after: dict[int, int], plan: StepPlan, live: bool) -> None:
        cfg = self.config
        ready = {}
        for req in self.active:
            if req.prefill_done:
                continue
            limit = req.ready_until(encoded_after.get(id(req), req.encoded_tokens))
            if limit > req.prefilled:
                ready[id(req)] = limit
        wanted = [r for r in self.active if id(r) in ready]
        prefill = plan.prefill
        budget = cfg.prefill_tokens
        rationed = live and not self.batch_heavy_ok
        batch_chunks = 0
        express = _least(wanted, key=lambda r: len(r.prompt) - r.prefilled)
        order = self._prefill_order(wanted, express)
        for req in [r for r in order if r.interactive] + [r for r in order if not r.interactive]:
            if req not in self.active:
                continue  # preempted
            done, limit = req.prefilled, ready[id(req)]
            while done < limit:
                end = min((done // cfg.prefill_chunk + 1) * cfg.prefill_chunk, len(req.prompt))
                if end > limit:  # its audio is not encoded yet
                    break
                n = end - done
                if live and not req.interactive and (batch_chunks or rationed):
                    return
                if prefill and n > budget:
                    return
                if not self._reserve(req, end, plan):
                    return
                prefill.append((req, n))
                budget -= n
                batch_chunks += not req.interactive
                done = end
                if req is express and len(wanted) > 1:
                    break  # the express lane

    def _prefill_order(self, wanted: list[Request], express: Request | None) -> list[Request]:
        if express is None or len(wanted) < 2:
            return wanted
        head = wanted[0]
        rest = [r for r in wanted if r is not head and r is not express]
        if express is head:
            return [head, *rest]
        self._turn = not self._turn
        return [express, head, *rest] if self._turn else [head, express, *rest]


def _may_preempt(req: Request, victim: Request) -> bool:
    """Interactive may preempt batch, not the reverse; within a kind only younger requests."""
    if victim.interactive != req.interactive:
        return req.interactive
    return victim.id > req.id


def _least(reqs: list[Request], key) -> Request | None:  # noqa: ANN001
    return min(reqs, key=key) if reqs else None


def _express_first(reqs: list[Request], key) -> list[Request]:  # noqa: ANN001
    if len(reqs) < 2:
        return reqs
    best = _least(reqs, key)
    return [best, *(r for r in reqs if r is not best)]


def _audio_prefilled(req: Request) -> int:
    return int(req.audio_before[req.prefilled])


def _by_group(waiting: deque[Request]) -> dict[object, deque[Request]]:
    queues: dict[object, deque[Request]] = {}
    for req in waiting:
        queues.setdefault(req.group_key, deque()).append(req)
    return queues


def _next_group(queues: dict[object, deque[Request]], running: Counter) -> object:
    """A preempted request's group, else the one with the fewest requests running."""
    for key, queue in queues.items():
        if queue[0].preempted:
            return key
    return min(queues, key=lambda key: running[key])
