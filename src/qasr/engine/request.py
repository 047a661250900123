"""One generation request and its progress through the engine."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass(eq=False)
class KVLease:
    """The KV blocks of a finished request that asked to keep them (``submit(keep_kv=True)``): positions
    [0, valid) hold the keys and values of its prompt. A later request whose prompt starts with the same
    tokens (and audio rows) takes the blocks over with ``submit(kv_prefix=(lease, n))`` and prefills
    from n on; ``engine.release(lease)`` frees a lease that is not taken over.

    A lease is a cache, not a reservation: when the pool runs out the engine may evict it (free its
    blocks) before preempting a running request; a request continuing an evicted lease then prefills
    its whole prompt, which gives the same bits (the prefix was prefilled on the same chunk grid)."""

    blocks: list[int]  # owned by the engine thread: empty once taken over, released or evicted
    valid: int
    prompt: tuple[int, ...]
    taken: bool = False  # handed to a request or released: usable once (set by the submitting thread)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated ids, EOS excluded
    finish_reason: str  # "eos" | "length"
    ttft_s: float  # submit -> first generated token
    latency_s: float  # submit -> done
    kv: KVLease | None = None  # the kept KV blocks, for requests submitted with keep_kv
    preempted: tuple[str, ...] = ()  # the phase ("prefill" / "decode") of each time it was preempted and recomputed
    # log-probability of each generated token under the model (float32 log-softmax of its logits at the id),
    # aligned with token_ids (EOS excluded); recomputation after a preemption gives the same values
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class EncodeResult:
    """An encoder-only request's result: the encoder's output rows, and the conv front end's output of the
    chunks it computed (the given conv head excluded); the whole chunks among them, with the conv head
    before them, can serve as a later request's ``conv_head`` while their features stay the same."""

    rows: torch.Tensor  # (rows, hidden)
    conv: torch.Tensor  # (chunks, tokens_per_conv_chunk, d_model)


@dataclass(frozen=True)
class Continuation:
    """How a request continues an earlier one (a live session's step continues the step before)."""

    keep_kv: bool = False  # on success keep the KV blocks: ``result.kv`` is a KVLease
    # (lease, n): reuse the lease's first n positions instead of prefilling them; n a multiple of the engine's
    # prefix_grid, and the caller vouches that the audio rows before n are the lease's. Used once.
    kv_prefix: tuple[KVLease, int] | None = None
    # ids the output is guessed to begin with, checked in extra decode rows where that cannot change a bit
    # (Engine.verifies_drafts), else ignored
    draft: Sequence[int] = ()


@dataclass(frozen=True)
class RequestSpec:
    """One generation request, as ``Engine.submit`` takes it (checked there by validate.check_spec).

    The audio is exactly one of ``waveform`` (1-D float, 16 kHz), ``features`` (mel, frames) or
    ``audio_embeds`` (the encoder's output rows, (audio tokens, hidden), on the model's device); ``prompt``
    holds one audio placeholder per encoder row (``ASR.prepare`` builds it). ``interactive`` and ``group``
    change a request's place in line, never its tokens (see scheduler.py)."""

    prompt: Sequence[int]
    max_new_tokens: int
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    audio_embeds: torch.Tensor | None = None
    ignore_eos: bool = False
    interactive: bool = False  # someone waits for it now: admitted and prefilled before batch work
    group: Hashable | None = None  # whose work it is: the group with the fewest running requests goes first
    continuation: Continuation = Continuation()


@dataclass(eq=False)
class Request:
    """A request inside the engine. ``spec`` is what was asked, its audio moved out into the fields below
    (each form is let go of once the next exists); everything after ``submitted`` is progress, owned by the
    engine thread."""

    spec: RequestSpec
    classify: np.ndarray | None = None  # alignment: sorted prompt positions whose head argmax is the result
    encode_only: bool = False  # Engine.submit_encode: no prompt, no KV; the result is an EncodeResult
    on_token: Callable[[int | None], None] | None = None  # each token, then None at the end
    audio_tokens: int = 0  # audio placeholders in the prompt (= encoder output rows)
    audio_before: np.ndarray | None = None  # (len(prompt) + 1,) audio placeholders in prompt[:i]
    kv_prefix: KVLease | None = None  # taken over at admission: its first ``prefix_len`` positions are reused
    prefix_len: int = 0
    # the audio as it is used: waveform -> features -> encoder rows; an encoder-only request's given conv
    # output of its first whole chunks, and the conv output of those the engine computed
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    conv_head: torch.Tensor | None = None
    future: Future = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    conv: torch.Tensor | None = None
    audio: torch.Tensor | None = None  # encoder rows (audio_tokens, hidden), kept until the end for recomputation
    encoded_tokens: int = 0  # rows of ``audio`` computed so far
    blocks: list[int] = field(default_factory=list)  # KV blocks held, in position order
    prefilled: int = 0  # prompt tokens in the cache
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each token of ``output``
    classes: list[int] = field(default_factory=list)  # argmax at the ``classify`` positions prefilled so far
    first_token_at: float | None = None
    # after a preemption: the tokens made before it, which the recomputation must reproduce (and does not
    # deliver again), and the phase of each preemption
    replay: list[int] = field(default_factory=list)
    delivered: int = 0  # tokens handed to on_token so far
    preempted: list[str] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt  # type: ignore[return-value]  # a list once checked

    @property
    def max_new_tokens(self) -> int:
        return self.spec.max_new_tokens

    @property
    def interactive(self) -> bool:
        return self.spec.interactive

    @property
    def group_key(self) -> object:
        """Whose share this request counts against: its group, or itself alone."""
        return ("request", self.id) if self.spec.group is None else self.spec.group

    @property
    def needs_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def encoded(self) -> bool:
        return self.encoded_tokens == self.audio_tokens

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()

    def draft_ahead(self, limit: int) -> tuple[int, ...]:
        """The next ``limit`` (at most) guessed ids after the output, while the output so far is the draft's
        start; () once it departs from it."""
        n, draft = len(self.output), self.spec.continuation.draft
        if limit <= 0 or n >= len(draft) or tuple(self.output) != draft[:n]:
            return ()
        return draft[n:n + limit]

    def ready_until(self, encoded: int) -> int:
        """Prompt tokens [0, n) whose audio embeddings exist once ``encoded`` audio tokens are encoded:
        everything before the (encoded + 1)-th audio placeholder (the whole prompt when all are)."""
        assert self.audio_before is not None, "set by the engine at submit"
        if encoded >= self.audio_tokens:
            return len(self.prompt)
        return int(np.searchsorted(self.audio_before, encoded + 1)) - 1

    def resolve(self, result: GenerationResult | list[int] | torch.Tensor | None = None,
                error: BaseException | None = None) -> None:
        """Settle the future once (a caller may have cancelled it meanwhile) and close the token stream.

        Both run user code on the engine thread (the future's done-callbacks, the token listener, e.g. a
        closed event loop's ``call_soon_threadsafe``): whatever it raises is logged and costs nothing
        more, so resolving one request never stops the engine from resolving the next. The request lets
        go of its audio: a finished or dropped request holds no waveform, features or encoder rows."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        except InvalidStateError:  # cancelled or already settled: nothing to tell
            pass
        except BaseException as exc:  # noqa: BLE001 - a done-callback's failure is its owner's, not the engine's
            log.warning("qasr: a done-callback of request %d raised %r", self.id, exc)
        listener, self.on_token = self.on_token, None
        if listener is not None:
            try:
                listener(None)
            except BaseException as exc:  # noqa: BLE001 - e.g. the consumer's event loop is closed
                log.warning("qasr: the token listener of request %d raised %r at its end", self.id, exc)
        self.waveform = self.features = self.audio = self.conv_head = self.conv = None
