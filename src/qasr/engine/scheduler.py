"""Decides what each engine step does: admissions, encoder work, prefill chunks, decode rows.

Pure bookkeeping on Request objects; no tensors are touched here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from qasr.engine.kv_cache import RegionAllocator
from qasr.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64  # sequences holding a KV region at once
    prefill_tokens: int = 512  # prompt tokens per step, in whole chunks (at least one chunk per step)
    prefill_chunk: int = 256  # a prompt is prefilled in pieces [0, C), [C, 2C), ... whatever shares the step
    encoder_tokens: int = 512  # encoder output tokens per step (whole requests; at least one)


@dataclass
class StepPlan:
    encode: list[Request]
    decode: list[Request]  # one token each
    prefill: list[tuple[Request, int]]  # (request, chunk length); a request's chunks are consecutive


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: RegionAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted, holding a KV region, in admission order

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def admit(self) -> list[Request]:
        """Move waiting requests into KV regions, oldest first. Returns those that can never fit."""
        impossible = []
        while self.waiting and len(self.active) < self.config.max_running:
            req = self.waiting[0]
            if req.future.cancelled():
                self.waiting.popleft()
                continue
            if req.needs_tokens > self.allocator.capacity:
                impossible.append(self.waiting.popleft())
                continue
            start = self.allocator.alloc(req.needs_tokens)
            if start is None:
                break  # wait for a region to free up; FIFO keeps latency fair
            self.waiting.popleft()
            req.start, req.reserved = start, req.needs_tokens
            self.active.append(req)
        return impossible

    def plan(self) -> StepPlan:
        """Every step runs all decode rows plus a bounded slice of the other work, so the running
        requests advance one token per step while newcomers are encoded and prefilled a little at a
        time: a decode step streams all the weights anyway, and prefill rows riding along use the
        compute that streaming leaves idle.

        Prefill chunks lie on a fixed grid per prompt, so the tokens a request sees in each forward
        (and hence its output, with row-invariant kernels) never depend on its neighbours."""
        cfg = self.config
        # Encode just in time: only while the encoded-but-unprefilled backlog is under two steps' worth.
        backlog = sum(len(r.prompt) - r.prefilled for r in self.active if r.encoded and not r.prefill_done)
        encode, budget = [], cfg.encoder_tokens
        if backlog < 2 * cfg.prefill_tokens:
            for req in self.active:
                if not req.encoded:
                    if encode and req.audio_tokens > budget:
                        break
                    encode.append(req)
                    budget -= req.audio_tokens
        decode = [r for r in self.active if r.prefill_done]
        encoding = {id(r) for r in encode}
        prefill, budget = [], cfg.prefill_tokens
        for req in self.active:  # admission order
            if req.prefill_done or (not req.encoded and id(req) not in encoding):
                continue
            done = req.prefilled
            while done < len(req.prompt):  # a request may bring several consecutive chunks
                n = min(cfg.prefill_chunk - done % cfg.prefill_chunk, len(req.prompt) - done)
                if prefill and n > budget:
                    return StepPlan(encode, decode, prefill)
                prefill.append((req, n))
                budget -= n
                done += n
        return StepPlan(encode, decode, prefill)

    def finish(self, req: Request) -> None:
        self.active.remove(req)
        self.allocator.free(req.start, req.reserved)
