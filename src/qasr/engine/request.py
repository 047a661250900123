"""One generation request and its progress through the engine."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Hashable
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


@dataclass(eq=False)
class Request:
    """A prompt plus its audio. Features are computed when the request is first encoded, not at submit,
    so a long queue holds only waveforms (or nothing extra when callers share arrays)."""

    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    waveform: np.ndarray | None = None
    features: torch.Tensor | None = None
    audio_tokens: int = 0  # audio placeholders in the prompt (= encoder output rows)
    on_token: Callable[[int | None], None] | None = None  # streaming: each token, then None at the end
    # alignment requests (max_new_tokens 0): sorted prompt positions whose head argmax is the result;
    # the request ends with its prefill
    classify: np.ndarray | None = None
    # encoder-only requests (``Engine.submit_encode``): no prompt, no KV; the result is an ``EncodeResult``
    encode_only: bool = False
    # an encoder-only request's given conv output of its first whole chunks (``features`` hold the frames after
    # them), and the conv output of the chunks the engine computed, returned with the rows
    conv_head: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    keep_kv: bool = False  # on success, keep the KV blocks and return them as a KVLease
    # a live session's step: admitted and prefilled before batch work, never preempted by it (see scheduler.py)
    interactive: bool = False
    # the caller's share of the running set (see scheduler.py): requests of one group (one call's pieces, one
    # upload's) queue behind each other, and the group with the fewest running requests is admitted first
    group: Hashable | None = None
    kv_prefix: KVLease | None = None  # continue this kept prefix: its first ``prefix_len`` positions are reused
    # ids the caller guesses the output begins with (``submit(draft=...)``): checked several at a time in one
    # forward while the output agrees with them; they never change what is generated
    draft: tuple[int, ...] = ()
    prefix_len: int = 0
    future: Future = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    # progress (owned by the engine thread)
    blocks: list[int] = field(default_factory=list)  # block table: KV blocks held, in position order
    # encoder output (audio_tokens, hidden), filled window by window; kept until the request ends, so a
    # preempted request recomputes its prefill without encoding again
    audio: torch.Tensor | None = None
    encoded_tokens: int = 0  # rows of ``audio`` computed so far
    audio_before: np.ndarray | None = None  # (len(prompt) + 1,) audio placeholders in prompt[:i]; set at submit
    prefilled: int = 0  # prompt tokens already in the cache
    output: list[int] = field(default_factory=list)
    classes: list[int] = field(default_factory=list)  # argmax at the ``classify`` positions prefilled so far
    first_token_at: float | None = None
    # preemption: the tokens produced before the last preemption, which the recomputation must reproduce
    # (and which are not delivered to on_token again), and the phase of each preemption
    replay: list[int] = field(default_factory=list)
    delivered: int = 0  # tokens handed to on_token so far
    preempted: list[str] = field(default_factory=list)
    # log-probability of each token of ``output`` (a recomputation overwrites them with the same values)
    logprobs: list[float] = field(default_factory=list)

    @property
    def group_key(self) -> object:
        """Whose share this request counts against: its group, or itself alone."""
        return ("request", self.id) if self.group is None else self.group

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
        n = len(self.output)
        if limit <= 0 or n >= len(self.draft) or tuple(self.output) != self.draft[:n]:
            return ()
        return self.draft[n:n + limit]

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
