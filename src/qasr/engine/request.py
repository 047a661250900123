"""A request: what it asks (RequestSpec), its result, its progress in the engine (Request)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np
import torch

from qasr.results import FinishReason

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass(eq=False)
class KVLease:
    """A finished ``keep_kv`` request's prompt KV, positions [0, valid); the engine may evict it."""

    blocks: list[int]  # the engine thread's
    valid: int
    prompt: tuple[int, ...]
    taken: bool = False


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # EOS excluded
    finish_reason: FinishReason  # "stop" (EOS) or "length" (max_new_tokens)
    ttft_s: float
    latency_s: float
    kv: KVLease | None = None
    preempted: tuple[str, ...] = ()  # "prefill" / "decode", one per preemption
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class EncodeResult:

    rows: torch.Tensor  # (rows, hidden)
    conv: torch.Tensor  # (chunks, tokens_per_conv_chunk, d_model)


@dataclass(frozen=True)
class Continuation:
    """How a request continues an earlier one (a live session's steps)."""

    keep_kv: bool = False  # keep the KV blocks: result.kv
    # (lease, n): reuse its first n positions (a multiple of Engine.prefix_grid)
    kv_prefix: tuple[KVLease, int] | None = None
    draft: Sequence[int] = ()  # ids the output likely begins with; never changes it


@dataclass(frozen=True)
class RequestSpec:
    """One generation request; audio: ``waveform`` (1-D, 16 kHz), ``features`` (mel, frames) or ``audio_embeds``.
    ``interactive``, ``group`` and ``lead`` change the place in line, not the tokens."""

    prompt: Sequence[int]
    max_new_tokens: int
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    audio_embeds: torch.Tensor | None = None
    ignore_eos: bool = False
    interactive: bool = False  # goes before batch work
    group: Hashable | None = None  # the group with the fewest running goes first
    lead: bool = False  # a batch request whose text is awaited: its group's other work waits while it runs
    continuation: Continuation = Continuation()


@dataclass(eq=False)
class Request:
    """``spec`` is what was asked (its audio moved below); fields after ``submitted``: the engine thread's."""

    spec: RequestSpec
    classify: np.ndarray | None = None  # alignment: sorted prompt positions
    encode_only: bool = False
    on_token: Callable[[int | None], None] | None = None
    audio_tokens: int = 0
    audio_before: np.ndarray | None = None  # [i]: in prompt[:i]
    kv_prefix: KVLease | None = None  # taken over at admission
    prefix_len: int = 0
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    conv_head: torch.Tensor | None = None
    future: Future = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    conv: torch.Tensor | None = None
    audio: torch.Tensor | None = None  # encoder rows
    encoded_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # KV blocks, in position order
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    classes: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    preempted: list[str] = field(default_factory=list)
    resumed: int = 0  # tokens of the output made before its last preemption: prefill inputs now

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt  # type: ignore[return-value]

    @property
    def max_new_tokens(self) -> int:
        return self.spec.max_new_tokens

    @property
    def interactive(self) -> bool:
        return self.spec.interactive

    @property
    def live(self) -> bool:
        """Someone waits for it: an interactive request or an encoder-only one (a live session's window)."""
        return self.spec.interactive or self.encode_only

    @property
    def group_key(self) -> object:
        return ("request", self.id) if self.spec.group is None else self.spec.group

    @property
    def needs_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def encoded(self) -> bool:
        return self.encoded_tokens == self.audio_tokens

    @property
    def prefill_len(self) -> int:
        return len(self.spec.prompt) + self.resumed

    @property
    def prefill_ids(self) -> list[int]:
        """What prefill runs over: the prompt, then the tokens made before the last preemption."""
        return [*self.prompt, *self.output[:self.resumed]] if self.resumed else self.prompt

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == self.prefill_len

    @property
    def context(self) -> int:
        """Positions a decode step needs: the prompt and every token made (the last one is its input)."""
        return len(self.spec.prompt) + len(self.output)

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()

    def draft_ahead(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` draft ids after the output, while the output agrees with the draft."""
        n, draft = len(self.output), self.spec.continuation.draft
        if limit <= 0 or n >= len(draft) or tuple(self.output) != draft[:n]:
            return ()
        return draft[n:n + limit]

    def ready_until(self, encoded: int) -> int:
        """The n of prompt[:n] that can be prefilled once ``encoded`` audio rows exist."""
        assert self.audio_before is not None, "set by the engine at submit"
        if encoded >= self.audio_tokens:
            return self.prefill_len
        return int(np.searchsorted(self.audio_before, encoded + 1)) - 1

    def audio_before_position(self, i: int) -> int:
        """Audio rows among prefill_ids[:i] (the tokens after the prompt hold none)."""
        assert self.audio_before is not None, "set by the engine at submit"
        return int(self.audio_before[min(i, len(self.audio_before) - 1)])

    def resolve(self, result: GenerationResult | list[int] | torch.Tensor | None = None,
                error: BaseException | None = None) -> None:
        """Settle the future, end the token stream, drop the audio. Never raises (callback errors are logged)."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        except InvalidStateError:
            pass
        except BaseException as exc:  # noqa: BLE001
            log.warning("qasr: a done-callback of request %d raised %r", self.id, exc)
        listener, self.on_token = self.on_token, None
        if listener is not None:
            try:
                listener(None)
            except BaseException as exc:  # noqa: BLE001
                log.warning("qasr: the token listener of request %d raised %r at its end", self.id, exc)
        self.waveform = self.features = self.audio = self.conv_head = self.conv = None
