"""Decides what each engine step does: admissions, encoder slices, prefill chunks, decode rows, and who
is preempted when the KV pool runs out.

Pure bookkeeping on Request objects; no tensors are touched here.

Fairness: a 20-minute piece is encoded a few 8 s windows per step and prefilled a few chunks per step,
so no step is long; and each step serves an "express lane" (the request with the least work left: one
encoder slice of at most half the budget, one prefill chunk) besides the oldest request, before the
rest in admission order. A short request that arrives behind a long one is therefore encoded in the
next step and prefilled within the next two, while the long one keeps moving.

Admission shares the running set between callers: each request names a group (``submit(group=...)``: one
call's pieces, one upload's; by default a group of its own), and when a place frees, the waiting request
whose group has the fewest requests running goes first, queue order within a group and between equals. A
20-minute file's 200 segments fill the running set only while nobody else waits: a short HTTP request
submitted behind them takes the next free place instead of waiting for all of them (docs/engine.md).

Memory (KV blocks, engine/kv_blocks.py): a request takes blocks as its prefill chunks are planned and
one more whenever a decode row crosses a block boundary. Where none are free, the oldest kept prefix
(a live session's lease) is evicted, then the youngest running request that holds blocks and is younger
than the one in need is preempted: its blocks are freed and it goes back to the head of the queue, to
recompute from scratch. The oldest running request can therefore always proceed (it fits the pool
alone: submit refuses larger ones), so memory never deadlocks.

Interactive requests (``submit(interactive=True)``: a live session's step, with someone waiting on it) are
admitted before the queue and beyond ``max_running``, prefilled before batch work, take blocks first and
may preempt batch requests, which never preempt them; among requests of one kind the rule above holds. A
caption therefore waits for one step, not for a 20-minute file queued before it.

While interactive work is in the engine, batch work's heavy parts (its encoder windows and prefill chunks)
are also rationed in time: the engine sets ``batch_heavy_ok`` before each plan (engine.py, from
``EngineConfig.live_batch_share``), and a step planned without it runs only decode rows, interactive work and
encoder-only requests. A live step needs a dozen engine steps (its encoding, its prefill, a token per step), so
their length is what a caption waits for; batch decode rows still ride along in every step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from qasr.engine.block_manager import BlockManager
from qasr.engine.request import Request

# guessed ids checked per request and step: a live step rolls back 5 tokens (more where a cut would split a
# character), and rows beyond the guesses that come true cost a forward's compute for nothing
DRAFT_ROWS = 8


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64  # sequences admitted at once (holding or about to take KV blocks)
    prefill_tokens: int = 512  # prompt tokens per step, in whole chunks (at least one chunk per step)
    prefill_chunk: int = 256  # a prompt is prefilled in pieces [0, C), [C, 2C), ... whatever shares the step
    encoder_tokens: int = 512  # encoder output tokens per step, in whole windows (at least one)
    window_tokens: int = 104  # the encoder's attention window: slices start on window boundaries


@dataclass
class StepPlan:
    encode: list[tuple[Request, int]]  # (request, audio tokens to encode now), from its encoded_tokens on
    decode: list[Request]  # one token each
    prefill: list[tuple[Request, int]]  # (request, chunk length); a request's chunks are consecutive
    # batch (non-interactive) encoder slices or prefill chunks planned while interactive work was in the engine
    live_batch_work: bool = False
    # by id(request) of a decode row: the guessed ids (Request.draft) fed after its newest token in rows of their own
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def requests(self) -> list[Request]:
        """Every request this plan touches, each once, in plan order."""
        seen: dict[int, Request] = {}
        for req in [*(r for r, _ in self.encode), *self.decode, *(r for r, _ in self.prefill)]:
            seen.setdefault(id(req), req)
        return list(seen.values())

    def only(self, req: Request) -> StepPlan:
        """The part of this plan that concerns one request (to rerun it alone after a failed step)."""
        own = {id(req): self.drafts[id(req)]} if id(req) in self.drafts else {}
        return StepPlan([(r, n) for r, n in self.encode if r is req], [r for r in self.decode if r is req],
                        [(r, n) for r, n in self.prefill if r is req], drafts=own)

    def drop(self, req: Request) -> None:
        """Take a preempted request out of the plan: it is back in the queue, and the step must not touch
        it (a failed step's rerun would end it as if it were running). Its encoder output so far is kept."""
        self.encode[:] = [(r, n) for r, n in self.encode if r is not req]
        self.decode[:] = [r for r in self.decode if r is not req]
        self.prefill[:] = [(r, n) for r, n in self.prefill if r is not req]
        self.drafts.pop(id(req), None)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted, in admission order
        self.encoding: list[Request] = []  # encoder-only requests (no KV), encoded whole at the next step
        self.preemptions = 0
        # whether this step may give batch work encoder slices and prefill chunks while interactive work is in
        # the engine (the engine rations those steps in time; without live work batch work is never held back)
        self.batch_heavy_ok = True
        self._turn = False  # which of the oldest request and the express lane is served first

    def add(self, req: Request) -> None:
        (self.encoding if req.encode_only else self.waiting).append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active and not self.encoding

    def admit(self) -> list[Request]:
        """Move waiting requests into the running set. Returns those that can never fit.

        Continuations whose kept blocks are still held go first (their memory is already taken, and
        they are a live session's next step). Then the queue, by groups (``_next_group``: preempted requests
        first, then the group with the fewest requests running, queue order within a group): the request
        chosen is admitted when the free blocks, counting kept prefixes (evictable) but not the blocks
        already promised to admitted prompts nor one per decode row, cover its prompt (and the tokens it
        must recompute, if it was preempted); or when nothing runs. Otherwise it waits, and so does
        everything else (nobody overtakes it for memory, so a large request is never starved).
        Interactive requests (live sessions' steps) go before all of that, wherever they stand and whatever
        ``max_running`` says (there is at most one per open session): they take their blocks when planned,
        from batch work if need be (``_reserve``).
        Cancelled waiting requests are dropped here."""
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
                req.resolve()  # closes a token stream, if any
            elif req.needs_tokens > self.blocks.allocator.capacity:
                taken.add(id(queues[key].popleft()))
                self._drop_lease(req)
                impossible.append(req)
            # a preempted request waits for room to get back to where it was, or it would be readmitted
            # at once and preempted again by the same older request, over and over
            elif self.active and self._room() < self.blocks.allocator.blocks_for(len(req.prompt) + len(req.replay)):
                break  # wait for blocks to free up (the request chosen is next once they do)
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
        """Blocks a newcomer's prompt may count on: free ones and kept prefixes, less what admitted
        prompts still need and one per decode row (the next boundary it crosses)."""
        alloc = self.blocks.allocator
        promised = sum(self.blocks.missing(r, len(r.prompt)) for r in self.active if not r.prefill_done)
        decoding = sum(r.prefill_done for r in self.active)
        return alloc.free_blocks + self.blocks.lease_blocks - promised - decoding

    def drop_cancelled(self) -> list[Request]:
        """Take the cancelled requests out of the waiting queue wherever they stand (not only at its head),
        returning the kept KV blocks they were to continue to the pool; the caller resolves them."""
        gone_encodes = [r for r in self.encoding if r.cancelled]
        self.encoding = [r for r in self.encoding if not r.cancelled]
        dropped = [r for r in self.waiting if r.cancelled]
        if dropped:  # keep exactly the others (a request cancelled meanwhile waits for the next step's sweep)
            gone = {id(r) for r in dropped}
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
            for req in dropped:
                self._drop_lease(req)
        return gone_encodes + dropped

    def _drop_lease(self, req: Request) -> None:
        if req.kv_prefix is not None:  # never admitted: its kept blocks go back to the pool
            self.blocks.release(req.kv_prefix)
            req.kv_prefix = None

    def retire(self, req: Request) -> None:
        """A finished request that keeps its blocks (keep_kv): out of the running set, blocks held."""
        self.active.remove(req)

    def finish(self, req: Request) -> None:
        """A request that ended (done, failed or cancelled): out of the running set, its blocks freed."""
        if req.encode_only:
            self.encoding.remove(req)
            return
        self.active.remove(req)
        self.blocks.free(req)
        req.audio = None

    def _reserve(self, req: Request, tokens: int, plan: StepPlan) -> bool:
        """Blocks for positions [0, tokens) of ``req``, evicting kept prefixes and preempting younger
        requests as needed. False: even that is not enough this step (the request waits; requests older
        than it hold the memory and will end or move on)."""
        while not self.blocks.grow(req, tokens):
            if self.blocks.evict_oldest():
                continue
            victims = [r for r in self.active if r.blocks and r is not req and _may_preempt(req, r)]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: (not r.interactive, r.id)), plan)  # batch first, youngest
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free a running request's blocks and queue it first, to recompute from scratch: its encoder
        output is kept, its prompt is prefilled again on the same chunk grid and its tokens decoded
        again (greedy and row-invariant kernels make them the same; the engine checks that they are and
        does not deliver them twice)."""
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
        """Every step runs all decode rows plus a bounded slice of the other work, so the running
        requests advance one token per step while newcomers are encoded and prefilled a little at a
        time: a decode step streams all the weights anyway, and prefill rows riding along use the
        compute that streaming leaves idle.

        Prefill chunks lie on a fixed grid per prompt and encoder slices on the window grid, so the
        work a request sees in each call (and hence its output, with row-invariant kernels) never
        depends on its neighbours.

        KV blocks are taken here, decode rows first (oldest first: they hold the most work), then the
        prefill chunks; a request that cannot get its blocks sits this step out (see ``_reserve``)."""
        live = self._live()
        plan = StepPlan(self._plan_encode(live), [], [])
        after = {id(r): r.encoded_tokens + n for r, n in plan.encode}  # encoded tokens once this step's slices ran
        for req in sorted(self.active, key=lambda r: not r.interactive):  # interactive rows get blocks first
            # the row stores the key of its newest token, position len(prompt) + len(output) - 1
            if req in self.active and req.prefill_done and self._reserve(req, len(req.prompt) + len(req.output), plan):
                plan.decode.append(req)
        self._plan_prefill(after, plan, live)
        self._plan_drafts(plan)
        if live:
            plan.live_batch_work = (any(not r.interactive and not r.encode_only for r, _ in plan.encode)
                                    or any(not r.interactive for r, _ in plan.prefill))
        return plan

    def _plan_drafts(self, plan: StepPlan) -> None:
        """A decode row's request with guessed ids ahead (``Request.draft``) gets up to ``DRAFT_ROWS`` more rows,
        one per guess, within its ``max_new_tokens``: the runner keeps the tokens of those whose guesses
        before them came true. Their blocks come from what is free once everything else is planned: a guess
        never evicts a kept prefix or preempts anyone."""
        for req in plan.decode:
            ahead = req.draft_ahead(min(DRAFT_ROWS, req.max_new_tokens - len(req.output) - 1))
            if ahead and self.blocks.grow(req, len(req.prompt) + len(req.output) + len(ahead)):
                plan.drafts[id(req)] = ahead

    def _live(self) -> bool:
        """Live work is in the engine: batch work gets one encoder window and one prefill chunk per step, and
        steps that carry them are rationed in time (``batch_heavy_ok``)."""
        return bool(self.encoding) or any(r.interactive for r in self.active)

    def _plan_encode(self, live: bool) -> list[tuple[Request, int]]:
        """Encoder-only requests whole (a live session's window or two, and it waits for them), then slices
        of the others' audio within what is left of the step's encoder budget (one window at least)."""
        cfg = self.config
        lookahead = 2 * cfg.prefill_tokens  # just in time: keep little encoded-but-unprefilled audio
        wanted = [r for r in self.active if not r.encoded
                  and r.encoded_tokens - _audio_prefilled(r) < lookahead]
        plan: list[tuple[Request, int]] = [(r, r.audio_tokens) for r in self.encoding if not r.cancelled]
        jobs = len(plan)
        budget = max(cfg.encoder_tokens - sum(n for _, n in plan), cfg.window_tokens)
        if live:
            budget = cfg.window_tokens  # live work waits on this step: batch audio gets one window of it
            if not self.batch_heavy_ok:  # ... or none, in the steps kept short for it
                wanted = [r for r in wanted if r.interactive]
        for k, req in enumerate(_express_first(wanted, key=lambda r: r.audio_tokens - r.encoded_tokens)):
            cap = budget // 2 if k == 0 and len(wanted) > 1 else budget  # the express lane takes at most half
            n = self._slice(req, max(cap, cfg.window_tokens))
            if len(plan) > jobs and n > budget:
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
        batch_chunks = 0  # while live work runs, batch work gets one prefill chunk per step (short steps)
        express = _least(wanted, key=lambda r: len(r.prompt) - r.prefilled)
        order = self._prefill_order(wanted, express)
        for req in [r for r in order if r.interactive] + [r for r in order if not r.interactive]:
            if req not in self.active:
                continue  # preempted for an earlier chunk of this step
            done, limit = req.prefilled, ready[id(req)]
            while done < limit:  # a request may bring several consecutive chunks
                end = min((done // cfg.prefill_chunk + 1) * cfg.prefill_chunk, len(req.prompt))
                if end > limit:
                    break  # the chunk's audio is not encoded yet: the grid stays fixed, so wait for it
                n = end - done
                if live and not req.interactive and (batch_chunks or rationed):
                    return
                if prefill and n > budget:
                    return
                if not self._reserve(req, end, plan):
                    return  # the pool is held by older requests: no more prefill this step
                prefill.append((req, n))
                budget -= n
                batch_chunks += not req.interactive
                done = end
                if req is express and len(wanted) > 1:
                    break  # the express lane gets one chunk per step

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


def _may_preempt(req: Request, victim: Request) -> bool:
    """Whether ``req``, short of blocks, may take ``victim``'s: batch work never preempts an interactive
    request, an interactive one may preempt any batch request, and otherwise only younger ones (so the
    oldest request of each kind can always proceed: no deadlock)."""
    if victim.interactive != req.interactive:
        return req.interactive
    return victim.id > req.id


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


def _by_group(waiting: deque[Request]) -> dict[object, deque[Request]]:
    """The waiting requests by group, each group's in queue order; groups in the order of their first request."""
    queues: dict[object, deque[Request]] = {}
    for req in waiting:
        queues.setdefault(req.group_key, deque()).append(req)
    return queues


def _next_group(queues: dict[object, deque[Request]], running: Counter) -> object:
    """Whose request is admitted next: a preempted one first (it was running, and sits at the queue's head),
    then the group with the fewest requests running; between equals, the group queued first. Over a step's
    admissions this takes turns between the groups, and a group with nothing running (a single short
    request) never waits for another's long queue."""
    for key, queue in queues.items():
        if queue[0].preempted:
            return key
    return min(queues, key=lambda key: running[key])  # min keeps the first of equals: dicts keep order
