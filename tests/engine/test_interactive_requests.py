"""Interactive requests (a live session's steps) go before batch work: admitted past a full queue and past
max_running, never preempted by batch work, with the same tokens as without the flag."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import noise, one_behind_a_queue, prompt_for

from qasr.engine.engine import Engine, EngineConfig, RequestSpec


def run_behind_a_queue(ck, interactive: bool) -> tuple[list[int], int, int]:  # noqa: ANN001
    """40 batch requests queued (4 run at once), then one more: its tokens, the steps it took from its
    submit to its end, and the steps the whole queue took."""
    return one_behind_a_queue(ck, EngineConfig(max_running=4, kv_block_tokens=16), 40, 3.0, 24,
                              late_kwargs={"interactive": interactive})


def test_an_interactive_request_does_not_wait_for_the_queue(ck) -> None:  # noqa: ANN001
    tokens, took, total = run_behind_a_queue(ck, interactive=True)
    plain, plain_took, _ = run_behind_a_queue(ck, interactive=False)
    assert tokens == plain  # the flag changes its place in line, not its tokens
    # admitted at once: encode, prefill, 6 decode steps, plus the steps the queue runs while this thread
    # waits for the GIL to see its result on a loaded machine
    assert took <= 18, took
    assert plain_took > 5 * took, (plain_took, took, total)  # without it, it waits behind the queue


def test_the_scheduler_takes_batch_blocks_for_an_interactive_request_never_the_reverse() -> None:
    """The memory rule alone, on a pool of 4 blocks: an older batch request short of a block takes none
    from a younger interactive one (it waits), and an interactive request takes a batch request's."""
    from qasr.engine.kv_blocks import BlockAllocator, BlockManager
    from qasr.engine.request import Request
    from qasr.engine.scheduler import Scheduler, SchedulerConfig, StepPlan

    def running(interactive: bool, blocks: int) -> Request:
        req = Request(RequestSpec([1] * 16 * blocks, 8, interactive=interactive))
        assert sched.blocks.grow(req, 16 * blocks)
        sched.active.append(req)
        return req

    sched = Scheduler(SchedulerConfig(), BlockManager(BlockAllocator(4, 16)))
    old_batch = running(False, 2)
    young_live = running(True, 2)  # the pool is full now
    assert not sched._reserve(old_batch, 16 * 3, StepPlan([], [], []))  # may not take the live request's
    assert young_live in sched.active and len(young_live.blocks) == 2 and sched.preemptions == 0
    assert sched._reserve(young_live, 16 * 3, StepPlan([], [], []))  # takes the batch request's blocks
    assert old_batch not in sched.active and sched.waiting[0] is old_batch and sched.preemptions == 1
    assert len(young_live.blocks) == 3


def test_while_live_work_runs_batch_work_gets_one_chunk_and_one_window_per_step() -> None:
    """Short steps while someone waits: batch prefill is one chunk per step and batch audio one encoder
    window, however much is ready; without interactive work the full budgets apply."""

    from qasr.engine.kv_blocks import BlockAllocator, BlockManager
    from qasr.engine.request import Request
    from qasr.engine.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(prefill_tokens=512, prefill_chunk=128, encoder_tokens=512, window_tokens=104)

    def batch_request() -> Request:  # a prompt of 512 text tokens, ready to prefill, and 520 audio tokens
        return Request(RequestSpec([1] * 512, 8), audio_tokens=520,
                       audio_before=np.zeros(513, dtype=np.int64))

    def plan_with(interactive: bool) -> tuple[int, int]:
        sched = Scheduler(cfg, BlockManager(BlockAllocator(1024, 16)))
        sched.active = [batch_request(), batch_request()]
        if interactive:
            sched.active.append(Request(RequestSpec([2] * 40, 4, interactive=True),
                                        audio_before=np.zeros(41, dtype=np.int64)))
        plan = sched.plan()
        batch_chunks = sum(1 for r, _ in plan.prefill if not r.interactive)
        batch_audio = sum(n for r, n in plan.encode if not r.interactive)
        return batch_chunks, batch_audio

    assert plan_with(interactive=False) == (4, 416)  # 512 prompt tokens in 128-token chunks; 4 windows of audio
    assert plan_with(interactive=True) == (1, 104)


def test_steps_the_engine_keeps_short_give_batch_work_no_chunk_and_no_window() -> None:
    """batch_heavy_ok False (the engine's ration of batch steps beside live work): the plan holds the live
    request's prefill and the batch requests' decode rows only, and says it carried no batch work; without
    live work the flag changes nothing."""
    from qasr.engine.kv_blocks import BlockAllocator, BlockManager
    from qasr.engine.request import Request
    from qasr.engine.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(prefill_tokens=512, prefill_chunk=128, encoder_tokens=512, window_tokens=104)

    def plan_with(interactive: bool, heavy_ok: bool):  # noqa: ANN202
        sched = Scheduler(cfg, BlockManager(BlockAllocator(1024, 16)))
        ready = Request(RequestSpec([1] * 512, 8), audio_tokens=520,
                        audio_before=np.zeros(513, dtype=np.int64))
        decoding = Request(RequestSpec([1] * 16, 8), audio_before=np.zeros(17, dtype=np.int64))
        decoding.prefilled = 16
        assert sched.blocks.grow(decoding, 17)
        sched.active = [ready, decoding]
        if interactive:
            sched.active.append(Request(RequestSpec([2] * 40, 4, interactive=True),
                                        audio_before=np.zeros(41, dtype=np.int64)))
        sched.batch_heavy_ok = heavy_ok
        plan = sched.plan()
        batch_chunks = sum(1 for r, _ in plan.prefill if not r.interactive)
        live_chunks = sum(1 for r, _ in plan.prefill if r.interactive)
        batch_audio = sum(n for r, n in plan.encode if not r.interactive)
        return batch_chunks, batch_audio, live_chunks, decoding in plan.decode, plan.live_batch_work

    assert plan_with(interactive=True, heavy_ok=True) == (1, 104, 1, True, True)
    assert plan_with(interactive=True, heavy_ok=False) == (0, 0, 1, True, False)
    assert plan_with(interactive=False, heavy_ok=False) == (4, 416, 0, True, False)  # no live work: no ration


def test_live_batch_share_rations_batch_steps_and_everything_finishes(ck) -> None:  # noqa: ANN001
    """A batch request beside a stream of interactive ones, at a small share: after every step that carried
    batch encoder or prefill work beside live work, the next step may not (the engine holds such steps to
    live_batch_share of the time); batch decode rows still run, and every request completes with the tokens it
    gets alone."""
    wave, live = noise(6.0, seed=3), noise(1.0, seed=4)
    with Engine(ck, EngineConfig(max_running=4, live_batch_share=1.0)) as engine:
        alone = engine.submit(RequestSpec(prompt_for(ck, wave), 8, waveform=wave, ignore_eos=True)).result(60)
    with Engine(ck, EngineConfig(max_running=4, live_batch_share=0.05, prefill_chunk=16, prefill_tokens=16)) as engine:
        seen: list[tuple[bool, bool]] = []  # per step: (batch_heavy_ok, the plan carried batch work beside live)
        plan = engine.core.scheduler.plan

        def recording_plan():  # noqa: ANN202
            got = plan()
            seen.append((engine.core.scheduler.batch_heavy_ok, got.live_batch_work))
            return got

        engine.core.scheduler.plan = recording_plan
        batch = engine.submit(RequestSpec(prompt_for(ck, wave), 8, waveform=wave, ignore_eos=True))
        lives = []
        while not batch.done() and len(lives) < 200:
            lives.append(engine.submit(RequestSpec(prompt_for(ck, live), 3, waveform=live, ignore_eos=True,
                                                   interactive=True)).result(timeout=60))
        result = batch.result(timeout=60)
    assert result.token_ids == alone.token_ids and all(len(r.token_ids) == 3 for r in lives)
    carried = [i for i, (_, work) in enumerate(seen) if work]
    assert carried, "the batch request never shared a step with live work: the test did not test"
    assert all(not seen[i + 1][0] for i in carried if i + 1 < len(seen))  # the next step was kept short
    assert any(not ok for ok, _ in seen)
    with pytest.raises(ValueError, match="live_batch_share"):
        EngineConfig(live_batch_share=0)
    with pytest.raises(ValueError, match="live_batch_share"):
        EngineConfig(live_batch_share=1.5)


def test_an_engine_going_idle_frees_its_threads_pool(ck) -> None:  # noqa: ANN001
    """The engine thread calls release_caller_threads (its idle OpenMP pool) each time it runs out of work, so
    that an idle engine does not slow a busy one in the same process."""
    import threading
    import time

    with Engine(ck, EngineConfig(max_running=2)) as engine:
        calls: list[str] = []
        release = engine.prepared.release_caller_threads
        object.__setattr__(engine.prepared, "release_caller_threads",
                           lambda: (calls.append(threading.current_thread().name), release()))
        wave = noise(1.0, seed=5)
        for _ in range(2):
            engine.submit(RequestSpec(prompt_for(ck, wave), 3, waveform=wave, ignore_eos=True)).result(timeout=60)
            deadline = time.monotonic() + 10
            while "qasr-engine" not in calls[-1:] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert calls[-1:] == ["qasr-engine"], calls  # the engine thread, once idle after the request
