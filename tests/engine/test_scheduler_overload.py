"""Overload both ways, counted in engine steps: live work submitted without pause does not starve batch work
(its share of each step), a batch backlog does not slow live work past its share, and an input's pieces come
out in submission order."""

from __future__ import annotations

import threading
import time

from conftest import noise, prompt_for

from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token

WAIT_S = 120


def tight(ck, pool: int = 640, **config) -> EngineConfig:  # noqa: ANN001, ANN003
    """A pool of ``pool`` tokens in 16-token blocks; a step holds about two windows and two 64-token chunks."""
    return EngineConfig(kv_cache_bytes=pool * kv_bytes_per_token(ck.config.decoder, ck.dtype), kv_block_tokens=16,
                        prefill_chunk=64, step_tokens=336, **config)


def batch_steps(engine: Engine, waves: list, tokens: int) -> int:
    """Steps from submitting ``waves`` as batch pieces of one group to the last one's end."""
    at = engine.steps
    futures = [engine.submit(RequestSpec(prompt_for(engine.checkpoint, w), tokens, waveform=w, ignore_eos=True,
                                         group="file")) for w in waves]
    for f in futures:
        assert len(f.result(WAIT_S).token_ids) == tokens
    return engine.steps - at


def test_live_work_without_pause_leaves_batch_work_its_share(ck) -> None:  # noqa: ANN001
    """Six interactive requests always in flight (each replaced the moment it ends) beside three batch
    pieces: the pieces finish within three times the steps they take alone."""
    waves = [noise(6.0, seed=40 + k) for k in range(3)]
    with Engine(ck, tight(ck)) as engine:
        alone = batch_steps(engine, waves, 24)
    live_wave = noise(2.0, seed=50)
    live_prompt = prompt_for(ck, live_wave)
    with Engine(ck, tight(ck)) as engine:
        stop = threading.Event()
        served = []

        def flood() -> None:
            while not stop.is_set():
                served.append(engine.submit(RequestSpec(live_prompt, 12, waveform=live_wave, ignore_eos=True,
                                                        interactive=True)).result(WAIT_S))

        floods = [threading.Thread(target=flood) for _ in range(6)]
        for t in floods:
            t.start()
        while len(served) < 2:  # the live work is under way
            time.sleep(0.001)
        try:
            crowded = batch_steps(engine, waves, 24)
        finally:
            stop.set()
            for t in floods:
                t.join(WAIT_S)
    assert len(served) > 6, "the live requests did not keep the engine busy: the test did not test"
    assert all(len(r.token_ids) == 12 for r in served)
    assert crowded <= 3 * alone, (crowded, alone)  # 4x before the shares (live work preempted batch work)


def test_a_batch_backlog_leaves_live_work_its_share(ck) -> None:  # noqa: ANN001
    """An interactive request behind a backlog of 30 batch pieces takes about the steps it takes alone."""
    live_wave = noise(3.0, seed=60)
    spec = RequestSpec(prompt_for(ck, live_wave), 8, waveform=live_wave, ignore_eos=True, interactive=True)
    with Engine(ck, tight(ck, max_running=8)) as engine:
        at = engine.steps
        engine.submit(spec).result(WAIT_S)
        alone = engine.steps - at
    with Engine(ck, tight(ck, max_running=8)) as engine:
        wave = noise(4.0, seed=61)
        backlog = [engine.submit(RequestSpec(prompt_for(ck, wave), 30, waveform=wave, ignore_eos=True))
                   for _ in range(30)]
        while engine.steps < 4:  # the backlog is under way
            time.sleep(0.001)
        at = engine.steps
        result = engine.submit(spec).result(WAIT_S)
        took = engine.steps - at
        done = sum(f.done() for f in backlog)
        for f in backlog:
            f.cancel()
    assert len(result.token_ids) == 8 and done < 30
    # its place in line: the steps it takes alone, plus a running request's end for a place (max_running
    # counts everyone) and the steps the loop runs while this thread waits for the GIL on a loaded machine
    assert took <= alone + 20, (took, alone)


def test_an_inputs_pieces_come_out_in_order(ck) -> None:  # noqa: ANN001
    """Sixteen pieces of one input submitted at once, all admitted: the first is done before the last has
    made its first token (the text of a long file starts early), and first tokens come in submission order."""
    waves = [noise(6.0, seed=70 + k) for k in range(16)]
    first_token: dict[int, int] = {}
    done: dict[int, int] = {}
    with Engine(ck, tight(ck, 4096, max_running=16)) as engine:

        def listener(k: int):  # noqa: ANN202
            def heard(token: int | None) -> None:
                if token is None:
                    done[k] = engine.steps
                else:
                    first_token.setdefault(k, engine.steps)
            return heard

        futures = [engine.submit(RequestSpec(prompt_for(ck, w), 6, waveform=w, ignore_eos=True, group="file"),
                                 on_token=listener(k)) for k, w in enumerate(waves)]
        for f in futures:
            f.result(WAIT_S)
    order = [first_token[k] for k in range(16)]
    assert order == sorted(order), order
    assert done[0] < first_token[15], (done[0], first_token[15])


def test_a_lead_runs_without_its_groups_other_work(ck) -> None:  # noqa: ANN001
    """Sixteen 20 s pieces of one group, the first the lead with 100 tokens, all in the engine before its second
    step (its group then has more than LEAD_HOLD_STEPS budgets of other work): from then until the lead's end no
    step encodes or prefills another piece of the group; after it, they all run."""
    waves = [noise(20.0, seed=70 + k) for k in range(16)]
    worked: list[tuple[int, bool, bool]] = []  # (step, the lead still running, a mate encoded or prefilled)
    submitted = threading.Event()
    with Engine(ck, tight(ck, 16384, max_running=16)) as engine:
        sched = engine.core.scheduler
        plan = sched.plan

        def recording_plan():  # noqa: ANN202
            submitted.wait(WAIT_S)  # the first step waits for every submission: no race with the test's thread
            step = plan()
            mates = any(not r.spec.lead for r, _ in [*step.encode, *step.prefill])
            worked.append((engine.steps, any(r.spec.lead for r in sched.active), mates))
            return step

        sched.plan = recording_plan
        specs = [RequestSpec(prompt_for(ck, w), 100 if k == 0 else 4, features=engine.log_mel(w), ignore_eos=True,
                             group="file", lead=k == 0) for k, w in enumerate(waves)]
        futures = [engine.submit(spec) for spec in specs]
        submitted.set()
        results = [f.result(WAIT_S) for f in futures]
    held = [mates for step, lead_running, mates in worked if step >= 1 and lead_running]
    assert len(held) > 90 and not any(held), worked
    assert all(len(r.token_ids) == (100 if k == 0 else 4) for k, r in enumerate(results))
