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
    prefill_tokens: int = 2048  # prompt tokens per step (chunked prefill), shared with decode rows
    encoder_tokens: int = 2048  # encoder output tokens per step (about 2.6 min of audio)


@dataclass
class StepPlan:
    encode: list[Request]
    decode: list[Request]  # one token each
    prefill: list[tuple[Request, int]]  # (request, chunk length)


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
        encode, budget = [], self.config.encoder_tokens
        for req in self.active:
            if not req.encoded:
                n = req.audio_tokens
                if encode and n > budget:
                    break
                encode.append(req)
                budget -= n
        decode = [r for r in self.active if r.prefill_done]
        # Prefill whole prompts when they fit the step's token budget (fewer, larger forwards). Only a
        # prompt longer than the whole budget is chunked, and then it gets the step to itself.
        encoding = {id(r) for r in encode}
        prefill, budget = [], max(self.config.prefill_tokens - len(decode), 1)
        for req in self.active:
            if (not req.encoded and id(req) not in encoding) or req.prefill_done:
                continue
            left = len(req.prompt) - req.prefilled
            if left <= budget:
                prefill.append((req, left))
                budget -= left
            elif not prefill:
                prefill.append((req, budget))
                break
            else:
                break  # keep arrival order: the next prompt waits for the next step
        return StepPlan(encode, decode, prefill)

    def finish(self, req: Request) -> None:
        self.active.remove(req)
        self.allocator.free(req.start, req.reserved)
