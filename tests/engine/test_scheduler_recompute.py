"""A preempted request comes back with one chunked prefill of its prompt and the tokens it had made, and goes
on from there: it never fails for its recomputation, never hands a token out twice, and where decode rows are
row-invariant a recomputed token that differs from the one made before is logged."""

from __future__ import annotations

import logging
import threading

from conftest import noise, prompt_for

from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.engine.runner import StepBatch

WAIT_S = 120


class Heard:
    """A token listener that records every token; once ``at`` are heard it submits ``then`` (on the engine
    thread, so the engine takes it before its next step)."""

    def __init__(self, at: int = 0, then=lambda: None) -> None:  # noqa: ANN001 - a callback
        self.at, self.then = at, then
        self.tokens: list[int] = []
        self.ended = threading.Event()

    def __call__(self, token: int | None) -> None:
        if token is None:
            self.ended.set()
            return
        self.tokens.append(token)
        if len(self.tokens) == self.at:
            self.then()


def preempted_in_decode(ck, wrap_run=None, checks: bool = False) -> tuple[object, Heard, Engine]:  # noqa: ANN001
    """A (400 tokens) and C (300 tokens, arriving once A has made one) in a pool of 32 blocks of 16: both
    decode until the pool runs out and C, the younger, is preempted. ``checks``: the runner checks recomputed
    rows (as where decode rows are row-invariant). Returns C's result, C's listener and the engine (closed)."""
    per_token = kv_bytes_per_token(ck.config.decoder, ck.dtype)
    eng = Engine(ck, EngineConfig(kv_cache_bytes=512 * per_token, kv_block_tokens=16, prefill_chunk=16,
                                  step_tokens=16))
    runner = eng.core.runner
    runner.checks_recompute = checks
    if wrap_run is not None:
        runner.run = wrap_run(runner.run)
    a_wave, c_wave = noise(2.0, seed=4), noise(2.0, seed=6)
    late = Heard()
    second = []
    gate = Heard(1, lambda: second.append(eng.submit(RequestSpec(prompt_for(ck, c_wave), 300, waveform=c_wave,
                                                                 ignore_eos=True), on_token=late)))
    with eng:
        first = eng.submit(RequestSpec(prompt_for(ck, a_wave), 400, waveform=a_wave, ignore_eos=True),
                           on_token=gate)
        a = first.result(WAIT_S)
        c = second[0].result(WAIT_S)
    assert a.preempted == () and c.preempted == ("decode",), (a.preempted, c.preempted)
    return c, late, eng


def test_a_preempted_request_goes_on_from_its_tokens_without_delivering_any_twice(ck) -> None:  # noqa: ANN001
    c, heard, eng = preempted_in_decode(ck)
    assert len(c.token_ids) == 300 and heard.tokens == c.token_ids and heard.ended.is_set()
    assert len(c.logprobs) == 300
    # one prefill of its prompt and of the tokens it had made (A's prompt, C's, then C's with its tokens),
    # not a step per recomputed token
    made = eng.timings["prefill_tokens"] - 3 * 42
    assert 0 < made < 300 and eng.steps < 400 + made, (made, eng.steps)


def test_a_recomputed_token_that_differs_is_logged_and_the_request_keeps_its_tokens(ck, caplog) -> None:  # noqa: ANN001
    """A backend that says decode rows are row-invariant but whose rows differ once recomputed (a stub: the
    first recomputed row's token is changed): the difference is logged, the request ends with the tokens it
    had made and delivered, and no error."""
    changed = []

    def differing(run):  # noqa: ANN001, ANN202
        def wrapped(batch: StepBatch):  # noqa: ANN202
            tokens, logprobs = run(batch)
            if batch.recomputed and not changed:
                first = batch.recomputed[0][1]
                changed.append(tokens[first])
                tokens[first] = (tokens[first] + 1) % ck.config.decoder.vocab_size
            return tokens, logprobs
        return wrapped

    with caplog.at_level(logging.WARNING, logger="qasr.engine.runner"):
        c, heard, _ = preempted_in_decode(ck, differing, checks=True)
    assert changed, "no recomputed row was checked: the test did not test"
    assert heard.tokens == c.token_ids and len(c.token_ids) == 300
    assert [r.getMessage() for r in caplog.records if "recomputed after preemption" in r.getMessage()]
