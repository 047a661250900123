"""Engine v2 through its public API: refusals at submit, a failing request fails alone, cancellation
frees its KV region, close resolves every future, a broken loop says so, token streaming, stats, and
fairness for a short request behind a long one. Runs on a head_dim-128 bf16 checkpoint too, so the
production kernels (flash prefill attention, AVX-512 decode attention, invariant GEMMs) run inside
the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import noise, prompt_for

from qasr.engine.cpu.native import attention_kernel, linear_kernel
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.model.checkpoint import load_checkpoint
from qasr.testing import make_tiny_checkpoint

KV = 64 << 20



@pytest.fixture(scope="module")
def ck128(tmp_path_factory):
    """bf16, head_dim 128 (the released models' head size): the engine runs qasr's production kernels."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("d128"), seed=3, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    return load_checkpoint(path, device="cpu", dtype="bfloat16")



def alone_tokens(ck, waves, max_new_tokens: int = 16, ignore_eos: bool = False) -> list[list[int]]:
    with Engine(ck, EngineConfig(kv_cache_bytes=KV, max_running=1)) as solo:
        return [solo.submit(RequestSpec(prompt_for(ck, w), max_new_tokens, waveform=w,
                                        ignore_eos=ignore_eos)).result().token_ids for w in waves]


def test_malformed_requests_are_refused_at_submit(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    w = noise(1.0)
    p = prompt_for(ck, w)
    bad = [
        (dict(waveform=np.full(16000, np.nan, np.float32)), "NaN"),
        (dict(waveform=np.zeros((2, 16000), np.float32)), "1-D"),
        (dict(waveform=np.zeros(100, np.float32)), "too short"),
        (dict(waveform=np.zeros(16000, np.int16)), "float"),
        (dict(waveform=noise(2.0)), "audio placeholders"),
        (dict(waveform=w, features=torch.zeros(128, 100)), "exactly one"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.submit(RequestSpec(p, 4, **kwargs))
    for n in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.submit(RequestSpec(p, n, waveform=w))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit(RequestSpec([*p, 10**9], 4, waveform=w))
    assert engine.submit(RequestSpec(p, 4, waveform=w)).result().token_ids  # still serving
    engine.close()


def test_a_failing_request_fails_alone_and_the_others_keep_their_tokens(ck) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate((2.0, 7.5, 3.1, 12.0, 5.0))]
    want = alone_tokens(ck, waves)
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    culprit = len(prompt_for(ck, waves[2]))  # the prompt length singles out the third request
    forward = engine.core.runner.forward
    failed_steps = []

    def faulty_forward(plan):  # noqa: ANN001, ANN202 - an injected fault inside the step
        if any(len(r.prompt) == culprit for r in plan.requests):
            failed_steps.append(len(plan.requests))
            raise RuntimeError("injected fault")
        return forward(plan)

    engine.core.runner.forward = faulty_forward
    gate = threading.Event()
    hold = noise(1.0, seed=77)  # its first token holds the loop until all five are queued behind it
    engine.submit(RequestSpec(prompt_for(ck, hold), 1, waveform=hold), on_token=lambda t: gate.wait())
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 16, waveform=w)) for w in waves]
    gate.set()
    with pytest.raises(RuntimeError, match="injected fault"):
        futures[2].result(timeout=60)
    assert max(failed_steps) > 1  # it did share a step with others
    got = [f.result(timeout=60).token_ids for k, f in enumerate(futures) if k != 2]
    assert got == [t for k, t in enumerate(want) if k != 2]
    assert not engine.stats().broken
    engine.close()


def test_cancel_mid_decode_frees_the_region_and_spares_the_others(ck) -> None:
    waves = [noise(s, seed=10 + k) for k, s in enumerate((4.0, 9.0))]
    want = alone_tokens(ck, waves, max_new_tokens=40, ignore_eos=True)
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    long_wave = noise(6.0, seed=99)
    seen = threading.Event()
    count = [0]

    def on_token(t: int | None) -> None:
        if t is not None:
            count[0] += 1
            if count[0] == 5:
                seen.set()

    victim = engine.submit(RequestSpec(prompt_for(ck, long_wave), 2000, waveform=long_wave, ignore_eos=True),
                           on_token=on_token)
    others = [engine.submit(RequestSpec(prompt_for(ck, w), 40, waveform=w, ignore_eos=True)) for w in waves]
    assert seen.wait(60)
    used_before = engine.stats().kv_tokens_used
    assert victim.cancel()
    assert [f.result(timeout=60).token_ids for f in others] == want
    deadline = time.time() + 10
    while engine.stats().kv_tokens_used != 0 and time.time() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert used_before >= len(prompt_for(ck, long_wave)) and stats.kv_tokens_used == 0  # blocks follow the tokens
    assert count[0] < 1000 and stats.running == 0  # it stopped long before its limit
    engine.close()


def test_cancelling_an_async_task_cancels_its_request(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    w = noise(3.0)

    async def main() -> None:
        task = asyncio.create_task(engine.generate_async(RequestSpec(prompt_for(ck, w), 5000, waveform=w,
                                                                     ignore_eos=True)))
        while engine.stats().generated_tokens < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.time() + 10
    while engine.stats().running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats().running == 0 and engine.stats().kv_tokens_used == 0
    engine.close()


@pytest.mark.parametrize("drain", [True, False])
def test_close_resolves_every_future(ck, drain: bool) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV, max_running=2))
    waves = [noise(1.0 + k % 5, seed=k) for k in range(12)]
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 30, waveform=w, ignore_eos=True)) for w in waves]
    engine.close(drain=drain, timeout=120)
    assert all(f.done() for f in futures)
    done = [f for f in futures if f.exception() is None]
    if drain:
        assert len(done) == 12 and all(len(f.result().token_ids) == 30 for f in done)
    else:
        closed = [f for f in futures if isinstance(f.exception(), EngineClosed)]
        assert len(closed) >= 8 and len(done) + len(closed) == 12
    with pytest.raises(EngineClosed):
        engine.submit(RequestSpec(prompt_for(ck, waves[0]), 4, waveform=waves[0]))


def test_an_error_in_the_loop_breaks_the_engine_loudly(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV, max_running=1))
    w = noise(2.0)
    first = engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w))
    first.result(timeout=60)

    def broken_plan():  # noqa: ANN202
        raise RuntimeError("scheduler bug")

    engine.core.scheduler.plan = broken_plan
    # the loop may break between two of these submits: a later one is then refused at once, also loudly
    outcomes: list = []
    for _ in range(3):
        try:
            outcomes.append(engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)))
        except EngineBroken as exc:
            outcomes.append(exc)
    assert not isinstance(outcomes[0], EngineBroken)  # accepted: the engine was healthy until its next step
    for o in outcomes:
        if isinstance(o, EngineBroken):
            assert "scheduler bug" in str(o)
            continue
        with pytest.raises(EngineBroken) as info:
            o.result(timeout=30)
        assert isinstance(info.value.__cause__, RuntimeError)
    assert engine.stats().broken
    with pytest.raises(EngineBroken, match="scheduler bug"):
        engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w))
    engine.close()


def test_streamed_tokens_equal_submitted_ones(ck) -> None:
    waves = [noise(s, seed=20 + k) for k, s in enumerate((2.5, 8.0))]
    want = alone_tokens(ck, waves, max_new_tokens=24)
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    assert [list(engine.tokens(RequestSpec(prompt_for(ck, w), 24, waveform=w))) for w in waves] == want

    async def collect(w: np.ndarray) -> list[int]:
        return [t async for t in engine.tokens_async(RequestSpec(prompt_for(ck, w), 24, waveform=w))]

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(*(collect(w) for w in waves)))

    assert asyncio.run(both()) == want
    # leaving a stream early cancels its request
    stream = engine.tokens(RequestSpec(prompt_for(ck, waves[1]), 3000, waveform=waves[1], ignore_eos=True))
    assert next(stream) == want[1][0]
    stream.close()
    deadline = time.time() + 10
    while engine.stats().running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats().running == 0
    engine.close()


def test_stats_report_the_engine_state(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    s0 = engine.stats()
    assert (s0.waiting, s0.running, s0.kv_tokens_used, s0.steps, s0.generated_tokens) == (0, 0, 0, 0, 0)
    assert s0.kv_tokens_total == engine.core.pool.tokens == s0.kv_blocks_total * s0.kv_block_tokens
    assert (s0.kv_blocks_used, s0.preemptions, s0.broken, s0.closed) == (0, 0, False, False)
    w = noise(2.0)
    out = engine.submit(RequestSpec(prompt_for(ck, w), 10, waveform=w, ignore_eos=True)).result()
    s1 = engine.stats()
    assert s1.generated_tokens == len(out.token_ids) == 10 and s1.steps >= 10 and s1.tokens_per_s > 0
    engine.close()
    assert engine.stats().closed


def test_short_request_behind_a_20_minute_piece_starts_within_a_few_steps(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=256 << 20))
    long_wave = noise(1200.0, seed=5)
    first_token_step: list[int] = []
    long_future = engine.submit(RequestSpec(prompt_for(ck, long_wave), 2, waveform=long_wave))
    while engine.stats().steps < 3:  # the long piece is being encoded
        time.sleep(0.001)
    short = noise(2.0, seed=6)
    submitted_at = engine.stats().steps
    f = engine.submit(RequestSpec(prompt_for(ck, short), 2, waveform=short),
                      on_token=lambda t: first_token_step.append(engine.steps) if t is not None else None)
    f.result(timeout=120)
    assert not long_future.done()  # the short one did not wait for the long prefill
    # admission + one encoder slice + one prefill chunk (+ the step in flight when it arrived)
    assert first_token_step[0] - submitted_at <= 5
    long_future.result(timeout=300)
    engine.close()


@pytest.mark.skipif(linear_kernel() is None or attention_kernel() is None,
                    reason="qasr's bf16 kernels need AVX512-BF16 and a C++ compiler")
def test_production_kernels_in_the_engine_give_batch_independent_tokens(ck128) -> None:
    engine = Engine(ck128, EngineConfig(kv_cache_bytes=KV))
    prepared = engine.prepared
    assert prepared.prefill_attention is not None and prepared.decode_attention is not None
    assert "invariant GEMM" in prepared.description
    waves = [noise(s, seed=30 + k) for k, s in enumerate((3.0, 17.0, 0.5, 9.0, 26.0))]
    want = alone_tokens(ck128, waves, max_new_tokens=20, ignore_eos=True)
    futures = [engine.submit(RequestSpec(prompt_for(ck128, w), 20, waveform=w, ignore_eos=True)) for w in waves]
    assert [f.result().token_ids for f in futures] == want
    assert len({t for toks in want for t in toks}) > 3  # not a degenerate model
    engine.close()


def test_two_engines_on_one_checkpoint_leave_the_model_untouched(ck128) -> None:
    model = ck128.model
    before = {n: type(m) for n, m in model.named_modules()}
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    a = Engine(ck128, EngineConfig(kv_cache_bytes=KV))
    b = Engine(ck128, EngineConfig(kv_cache_bytes=KV, native_kernels=False))
    assert a.prepared.kernels is not b.prepared.kernels
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights
    w = noise(2.0)
    assert b.submit(RequestSpec(prompt_for(ck128, w), 5, waveform=w)).result().token_ids is not None
    a.close()
    b.close()


def test_the_kernel_line_names_its_model(caplog) -> None:
    """A server with an aligner logs two kernel lines: each says whose."""
    models = Path(__file__).resolve().parents[2] / "models"
    with caplog.at_level(logging.INFO, logger="qasr.engine"):
        for folder in ("qasr-demo-en", "qasr-demo-aligner-en"):
            checkpoint = load_checkpoint(models / folder, device="cpu", dtype="float32")
            Engine(checkpoint, EngineConfig(kv_cache_bytes=KV)).close()
    lines = [r.getMessage() for r in caplog.records if ": CPU kernels: " in r.getMessage()]
    assert [line.split(": CPU kernels: ")[0] for line in lines] == ["qasr: model qasr-demo-en",
                                                                     "qasr: aligner qasr-demo-aligner-en"]


def test_a_cached_snapshot_is_labelled_by_its_hub_id(ck) -> None:
    snapshot = Path("/cache/hub/models--Qwen--Qwen3-ASR-0.6B/snapshots/0123abcd")
    assert dataclasses.replace(ck, path=snapshot).label == "model Qwen/Qwen3-ASR-0.6B"


def test_the_log_mel_is_made_at_submit_and_counted_in_the_request_times(ck) -> None:
    """On CPU the submitting thread makes the log-mel (no engine step does), and a result's ttft_s and
    latency_s count from the call to submit, so that time is in them."""
    with Engine(ck, EngineConfig(kv_cache_bytes=KV)) as engine:
        made = engine.log_mel
        threads: list[str] = []

        def slow(wave):  # noqa: ANN001, ANN202
            threads.append(threading.current_thread().name)
            time.sleep(0.3)
            return made(wave)

        engine.log_mel = slow
        wave = noise(1.0, seed=3)
        result = engine.submit(RequestSpec(prompt_for(ck, wave), 2, waveform=wave)).result(timeout=60)
        assert threads == [threading.current_thread().name]
        assert 0.3 <= result.ttft_s <= result.latency_s
        assert engine.timings["features_s"] < 0.1  # the engine only slices the features it was given
