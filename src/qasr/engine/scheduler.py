"""What each engine step does: admissions, encoder slices, prefill chunks, decode rows, preemptions.
Engine thread only; the reasoning is in docs/engine.md.

The policy: every request has a rank, live work (interactive requests and encoder-only requests) before batch work,
then age (submission order), so within one input the earlier pieces go first. Admission takes waiting requests by
rank (batch ones by group first: the group with the fewest running, preempted requests ahead) while ``max_running``
allows and the KV blocks and audio memory they need are there for the taking; nothing overtakes a request that waits
for room. Each step has one budget, ``step_tokens``, counting decode rows (drafts' rows included), prefill tokens
and encoder rows. Every decode row runs and is counted first; encoder-only requests come whole; what is left goes by
rank to each request's next encoder slice, then its prefill chunks once their audio is encoded, a batch request
taking at most half while another waits for such work (so a short request is not held behind a long one's prompt).
While a ``lead`` request (a piece whose text a caller streams, such as a long file's first) is admitted and the
other requests of its group have ``LEAD_HOLD_STEPS`` budgets of encoder and prefill work left, they get none of it,
so its text comes after its own work, not its group's. While live work is in the engine, batch work rides in one
step of ``BATCH_EVERY`` with ``BATCH_SHARE`` of what is left, so neither class starves the other and the steps live
work waits for stay short. A class that works in a step gets one window and one chunk whatever is left, so a step
whose decode rows fill the budget still moves encoder and prefill work. When blocks run out, kept leases are
evicted, then the lowest-ranked running request below the one in need is preempted; one preempted ``PREEMPT_CAP``
times is spared by all but the top-ranked request, which can always go on.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from qasr.engine.kv_blocks import BlockManager
from qasr.engine.request import Request

DRAFT_ROWS = 8  # guesses checked per request and step
BATCH_SHARE = 0.25  # of what a step's decode rows leave of its budget: batch work's while live work is in the engine
BATCH_EVERY = 4  # while live work is in the engine, batch work's share rides in one step of this many
PREEMPT_CAP = 2  # preemptions after which a request is no longer a victim (but of the top-ranked request)
LEAD_HOLD_STEPS = 8  # a lead holds its group while the group has this many budgets of other work left


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64
    step_tokens: int = 1024  # decode rows + prefill tokens + encoder rows per step (Scheduler.plan)
    prefill_chunk: int = 256  # prefill grid
    window_tokens: int = 104  # encoder slice grid
    audio_memory_bytes: int = 1 << 62  # features and encoder rows of admitted requests
    audio_token_bytes: int = 0  # one audio token's encoder row and share of the features


@dataclass
class StepPlan:
    encode: list[tuple[Request, int]]  # (request, audio tokens)
    decode: list[Request]
    prefill: list[tuple[Request, int]]  # (request, chunk length), in order
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


def rank(req: Request) -> tuple[bool, int]:
    """Lower goes first: live work, then age."""
    return not req.live, req.id


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # in admission order
        self.encoding: list[Request] = []  # encoder-only requests
        self.preemptions = 0
        self.planned = 0  # steps planned

    def add(self, req: Request) -> None:
        (self.encoding if req.encode_only else self.waiting).append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active and not self.encoding

    @property
    def audio_bytes(self) -> int:
        """Features and encoder rows held by admitted requests, and by preempted ones that kept their rows."""
        held = [*self.active, *(r for r in self.waiting if r.audio is not None)]
        return sum(r.audio_tokens for r in held) * self.config.audio_token_bytes

    def admit(self) -> list[Request]:
        """Admit waiting requests by rank while they fit; return those that never can."""
        impossible = []
        admitted: set[int] = set()
        audio = self.audio_bytes
        for req in self._admission_order():
            if len(self.active) >= self.config.max_running:
                break
            if req.cancelled:
                admitted.add(id(req))
                self._drop_lease(req)
                req.resolve()
                continue
            if req.needs_tokens > self.blocks.allocator.capacity:
                admitted.add(id(req))
                self._drop_lease(req)
                impossible.append(req)
                continue
            cost = 0 if req.audio is not None else req.audio_tokens * self.config.audio_token_bytes
            held = req.kv_prefix is not None and bool(req.kv_prefix.blocks)  # its memory is taken already
            if self.active and not held and (audio + cost > self.config.audio_memory_bytes
                                             or self._room(req) < self._needs(req)):
                break  # nothing overtakes it, so a large request is never starved
            admitted.add(id(req))
            audio += cost
            if req.kv_prefix is not None:
                self.blocks.take_over(req)
            self.active.append(req)
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return impossible

    def _admission_order(self) -> Iterator[Request]:
        """Live requests by age; then batch: a preempted one first, else the group with the fewest running
        (queue order within a group and between equals). Lazy: admission stops at the first that waits."""
        yield from sorted((r for r in self.waiting if r.live), key=rank)
        queues = _by_group(r for r in self.waiting if not r.live)
        running = Counter(r.group_key for r in self.active if not r.live)
        while queues:
            key = _next_group(queues, running)
            yield queues[key].popleft()
            running[key] += 1
            if not queues[key]:
                del queues[key]

    def _needs(self, req: Request) -> int:
        """Blocks to get back where it was: its prompt, and the tokens it had made if it was preempted."""
        return self.blocks.allocator.blocks_for(req.prefill_len)

    def _room(self, req: Request) -> int:
        """Blocks ``req`` may count on: free ones, kept leases (evictable) and those of the requests it may
        preempt, less what admitted prompts still need and one per decode row."""
        alloc = self.blocks.allocator
        promised = sum(self.blocks.missing(r, r.prefill_len) for r in self.active if not r.prefill_done)
        decoding = sum(r.prefill_done for r in self.active)
        victims = sum(len(r.blocks) for r in self.active if rank(r) > rank(req) and len(r.preempted) < PREEMPT_CAP)
        return alloc.free_blocks + self.blocks.lease_blocks + victims - promised - decoding

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
            victim = self._victim(req)
            if victim is None:
                return False
            self._preempt(victim, plan)
        return True

    def _victim(self, req: Request) -> Request | None:
        """The lowest-ranked running request below ``req`` that holds blocks; one preempted PREEMPT_CAP times
        only for the top-ranked request (so the head of the line always goes on and nothing deadlocks)."""
        below = [r for r in self.active if r.blocks and rank(r) > rank(req)]
        if req is not min(self.active, key=rank):
            below = [r for r in below if len(r.preempted) < PREEMPT_CAP]
        return max(below, key=rank, default=None)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free a running request's blocks and queue it first; its tokens so far become prefill inputs."""
        self.active.remove(req)
        self.blocks.free(req)
        plan.drop(req)
        req.preempted.append("decode" if req.prefill_done else "prefill")
        req.resumed = len(req.output)
        req.prefilled = 0
        req.classes = []
        self.waiting.appendleft(req)
        self.preemptions += 1

    def plan(self) -> StepPlan:
        """The next step: every decode row and its guesses, then encoder and prefill work by rank within what
        they leave of ``step_tokens``; KV blocks are taken here."""
        self.planned += 1
        plan = StepPlan([(r, r.audio_tokens) for r in self.encoding if not r.cancelled], [], [])
        for req in sorted(self.active, key=rank):
            if req in self.active and req.prefill_done and self._reserve(req, req.context, plan):
                plan.decode.append(req)
        guesses = {id(r): g for r in plan.decode
                   if (g := r.draft_ahead(min(DRAFT_ROWS, r.max_new_tokens - len(r.output) - 1)))}
        rows = len(plan.decode) + sum(len(g) for g in guesses.values())
        self._plan_work(plan, self.config.step_tokens - rows)
        for req in plan.decode:  # a guess takes only free blocks: it never evicts or preempts
            ahead = guesses.get(id(req))
            if ahead and self.blocks.grow(req, req.context + len(ahead)):
                plan.drafts[id(req)] = ahead
        return plan

    def _wants_slice(self, req: Request) -> bool:
        """Its audio is not all encoded and its prefill is less than a step's budget behind its encoder."""
        return not req.encoded and (req.encoded_tokens - req.audio_before_position(req.prefilled)
                                    < self.config.step_tokens)

    def _plan_work(self, plan: StepPlan, left: int) -> None:
        """Encoder slices and prefill chunks by rank within ``left`` tokens and the class caps: each request its
        next slice (whole windows), then its chunks (on its grid) as far as their audio is encoded. A class
        that works in this step gets one window and one chunk whatever is left (its floor)."""
        cfg = self.config
        left = max(left, 0)
        held = self._held_groups()
        wanted = sorted((r for r in self.active if (r.live or r.spec.lead or r.group_key not in held)
                         and (self._wants_slice(r)
                              or (not r.prefill_done and r.ready_until(r.encoded_tokens) > r.prefilled))), key=rank)
        turn, cap = self._caps(left, wanted)
        # while another batch request waits for work, one takes at most half of ``left`` (live requests are short)
        each = {True: left, False: left // 2 if sum(not r.live for r in wanted) > 1 else left}
        used = sum(n for _, n in plan.encode)  # encoder-only requests: live work, whole
        spent = {True: used, False: 0}
        windowed = {True: bool(plan.encode), False: False}  # the class had its floor's window
        chunked = {True: False, False: False}  # and its chunk
        short = False  # out of KV blocks: no more prefill this step
        for req in wanted:
            live = req.live
            if not turn[live] or req not in self.active:  # not its class's step, or preempted meanwhile
                continue
            sliced = 0
            if self._wants_slice(req):
                room = min(left - used, cap[live] - spent[live], each[live])
                sliced = max(self._slice(req, room if windowed[live] else max(room, cfg.window_tokens)), 0)
                if sliced:
                    plan.encode.append((req, sliced))
                    used += sliced
                    spent[live] += sliced
                    windowed[live] = True
            if short or req.prefill_done:
                continue
            done, own = req.prefilled, sliced
            limit = req.ready_until(req.encoded_tokens + sliced)
            prompt_chunk = False
            while done < limit:
                end = min((done // cfg.prefill_chunk + 1) * cfg.prefill_chunk, req.prefill_len)
                if done < len(req.prompt):
                    end = min(end, len(req.prompt))  # the prompt's chunks as when it was first prefilled
                elif prompt_chunk:
                    break  # made tokens run as decode rows, which attend before the step's chunks are stored
                if end > limit:  # its audio is not encoded yet
                    break
                n = end - done
                if chunked[live] and (used + n > left or spent[live] + n > cap[live] or own + n > each[live]):
                    break
                if not self._reserve(req, end, plan):
                    short = True
                    break
                plan.prefill.append((req, n))
                used += n
                own += n
                spent[live] += n
                chunked[live] = True
                prompt_chunk = prompt_chunk or done < len(req.prompt)
                done = end

    def _held_groups(self) -> set[object]:
        """Groups whose admitted lead holds their other requests' encoder and prefill work: those whose other
        requests have at least LEAD_HOLD_STEPS budgets of it left, so the wait the hold spares the lead's text
        outweighs its cost (the lead's decode steps, which nothing of its group shares)."""
        leads = {r.group_key for r in self.active if r.spec.lead and not r.live}
        if not leads:
            return set()
        work: Counter = Counter()
        for req in [*self.active, *self.waiting]:
            if req.group_key in leads and not (req.spec.lead or req.live):
                work[req.group_key] += req.audio_tokens - req.encoded_tokens + req.prefill_len - req.prefilled
        return {g for g in leads if work[g] >= LEAD_HOLD_STEPS * self.config.step_tokens}

    def _caps(self, left: int, wanted: list[Request]) -> tuple[dict[bool, bool], dict[bool, int]]:
        """Whether each class (live: True) works in this step, and what it may take of ``left``. Without live
        work in the engine, batch work all of it. With it, batch work BATCH_SHARE of it in one step of
        BATCH_EVERY and nothing in the others, so the steps a live request waits for stay short; live work the
        rest."""
        live_in = any(r.live for r in self.active) or any(not r.cancelled for r in self.encoding)
        if not live_in:
            return {True: True, False: True}, {True: left, False: left}
        if self.planned % BATCH_EVERY or all(r.live for r in wanted):
            return {True: True, False: False}, {True: left, False: 0}
        share = int(left * BATCH_SHARE)
        return {True: True, False: True}, {True: left - share, False: share}

    def _slice(self, req: Request, room: int) -> int:
        """Whole windows of ``req``'s audio within ``room`` (its last window may be short); 0 if none fits."""
        left = req.audio_tokens - req.encoded_tokens
        n = min(left, max(room, 0) // self.config.window_tokens * self.config.window_tokens)
        return left if n == 0 and left <= room else n


def _by_group(reqs: Iterable[Request]) -> dict[object, deque[Request]]:
    queues: dict[object, deque[Request]] = {}
    for req in reqs:
        queues.setdefault(req.group_key, deque()).append(req)
    return queues


def _next_group(queues: dict[object, deque[Request]], running: Counter) -> object:
    """A preempted request's group, else the one with the fewest requests running."""
    for key, queue in queues.items():
        if queue[0].preempted:
            return key
    return min(queues, key=lambda key: running[key])
