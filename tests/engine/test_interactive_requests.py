"""Interactive requests (a live session's steps) go before batch work: admitted first (by the room rule of
every request, max_running counting them), never preempted by batch work, with the same tokens as without
the flag."""

from __future__ import annotations

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
    # admitted at the next free place (max_running counts it: a running request ends within its 24 tokens),
    # then encode, prefill, 6 decode steps, plus the steps the queue runs while this thread waits for the GIL
    # to see its result on a loaded machine
    assert took <= 40, took
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


def test_a_batch_request_beside_a_stream_of_interactive_ones_keeps_its_tokens(ck) -> None:  # noqa: ANN001
    """A batch request beside interactive requests submitted one after the other: its encoder and prefill work
    rides in one step of BATCH_EVERY while they are in the engine, and every request ends with the tokens it
    gets alone."""
    from qasr.engine.scheduler import BATCH_EVERY

    wave, live = noise(12.0, seed=3), noise(1.0, seed=4)
    config = EngineConfig(max_running=4, prefill_chunk=16, step_tokens=32)
    with Engine(ck, config) as engine:
        alone = engine.submit(RequestSpec(prompt_for(ck, wave), 8, waveform=wave, ignore_eos=True)).result(60)
        live_alone = engine.submit(RequestSpec(prompt_for(ck, live), 3, waveform=live, ignore_eos=True)).result(60)
    with Engine(ck, config) as engine:
        batch_beside_live: list[int] = []  # the steps whose plan carried batch work while live work was in
        sched = engine.core.scheduler
        plan = sched.plan

        def recording_plan():  # noqa: ANN202
            got = plan()
            if any(not r.live for r, _ in [*got.encode, *got.prefill]) and any(r.live for r in sched.active):
                batch_beside_live.append(sched.planned)
            return got

        sched.plan = recording_plan
        live_spec = RequestSpec(prompt_for(ck, live), 3, waveform=live, ignore_eos=True, interactive=True)
        first = engine.submit(live_spec)
        batch = engine.submit(RequestSpec(prompt_for(ck, wave), 8, waveform=wave, ignore_eos=True))
        lives = [first.result(timeout=60)]
        while not batch.done() and len(lives) < 200:
            lives.append(engine.submit(live_spec).result(timeout=60))
        result = batch.result(timeout=60)
    assert result.token_ids == alone.token_ids and all(r.token_ids == live_alone.token_ids for r in lives)
    assert len(lives) > 1, "the batch request never ran beside live work: the test did not test"
    assert all(step % BATCH_EVERY == 0 for step in batch_beside_live), batch_beside_live


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
