"""The scheduling policy on the scheduler alone: rank (live work, then age), each class's share of the steps'
budgets under overload, the same room rule for every kind, the audio memory budget (and, through an engine,
that its setting reaches the scheduler) and the preemption cap."""

from __future__ import annotations

import numpy as np

from qasr.engine.kv_blocks import BlockAllocator, BlockManager
from qasr.engine.request import Request, RequestSpec
from qasr.engine.scheduler import BATCH_EVERY, BATCH_SHARE, PREEMPT_CAP, Scheduler, SchedulerConfig, StepPlan

CFG = SchedulerConfig(prefill_tokens=512, prefill_chunk=128, encoder_tokens=520, window_tokens=104)


def ready(prompt: int, interactive: bool = False, audio: int = 0) -> Request:
    """A request whose prompt can be prefilled now (its audio placeholders, if any, all after the text)."""
    return Request(RequestSpec([1] * prompt, 8, interactive=interactive), audio_tokens=audio,
                   audio_before=np.zeros(prompt + 1, dtype=np.int64))


def scheduler(blocks: int = 1024, block: int = 16, **config) -> Scheduler:  # noqa: ANN003
    return Scheduler(SchedulerConfig(**{**CFG.__dict__, **config}), BlockManager(BlockAllocator(blocks, block)))


def shares(plan: StepPlan) -> tuple[int, int, int, int]:
    """(live prefill tokens, batch prefill tokens, live encoder rows, batch encoder rows) of a plan."""
    return (sum(n for r, n in plan.prefill if r.live), sum(n for r, n in plan.prefill if not r.live),
            sum(n for r, n in plan.encode if r.live), sum(n for r, n in plan.encode if not r.live))


def test_under_overload_batch_work_rides_in_one_step_of_batch_every() -> None:
    """Both classes with far more ready work than a step holds: in one step of BATCH_EVERY batch work gets its
    share of each budget (BATCH_SHARE, in whole chunks and windows) and live work the rest; in the others live
    work gets the whole budgets. With one class alone it gets the whole budgets every step; encoder-only
    requests (live sessions' windows) are encoded whole, whatever the budget."""
    sched = scheduler()
    sched.active = [*(ready(2048, audio=1040) for _ in range(4)),
                    *(ready(2048, interactive=True, audio=1040) for _ in range(4))]
    floor_p = int(512 * BATCH_SHARE) // 128 * 128
    floor_e = int(520 * BATCH_SHARE) // 104 * 104
    seen = []
    for _ in range(2 * BATCH_EVERY):
        plan = sched.plan()
        seen.append(shares(plan))
        for req, n in plan.prefill:
            req.prefilled += n
        for req, n in plan.encode:
            req.encoded_tokens += n
    batch_step = (512 - floor_p, floor_p, 520 - floor_e, floor_e)
    assert seen == ([(512, 0, 520, 0)] * (BATCH_EVERY - 1) + [batch_step]) * 2
    batch_only = scheduler()
    batch_only.active = [ready(2048, audio=1040) for _ in range(2)]
    assert [shares(batch_only.plan()) for _ in range(BATCH_EVERY)] == [(0, 512, 0, 520)] * BATCH_EVERY
    live_only = scheduler()
    live_only.active = [ready(2048, interactive=True) for _ in range(2)]
    live_only.encoding = [Request(RequestSpec([], 0), audio_tokens=208, encode_only=True) for _ in range(4)]
    assert shares(live_only.plan()) == (512, 0, 832, 0)


def test_work_goes_by_rank_live_first_then_age() -> None:
    """Prefill chunks go to live work first, then to the oldest request, whatever the admission order."""
    sched = scheduler()
    old, young = ready(300), ready(300)
    live = ready(100, interactive=True)
    sched.active = [young, old, live]
    sched.planned = BATCH_EVERY - 1  # the next step is one where batch work rides beside live work
    assert sched.plan().prefill == [(live, 100), (old, 128)]  # its share
    sched.active.remove(live)
    assert sched.plan().prefill == [(old, 128), (old, 128), (old, 44), (young, 128)]  # 428 of 512


def test_interactive_requests_wait_for_room_and_count_toward_max_running() -> None:
    """The room rule is every kind's: an interactive request is admitted first but only when the blocks it may
    count on (free, kept, or a lower-ranked request's) cover its prompt; max_running counts it."""
    sched = scheduler(blocks=8, block=16, max_running=2)
    older_live = ready(16 * 7, interactive=True)
    assert sched.blocks.grow(older_live, 16 * 7)
    sched.active.append(older_live)  # 7 of 8 blocks held by a request it may not preempt
    live = ready(16 * 3, interactive=True)
    batch = ready(16)
    sched.add(batch)
    sched.add(live)
    assert sched.admit() == [] and sched.active == [older_live]  # it waits, and the batch request behind it
    sched.blocks.free(older_live)
    sched.active.clear()
    busy = [ready(16), ready(16)]
    for req in busy:
        assert sched.blocks.grow(req, 16)
    sched.active = busy  # two batch requests: max_running reached
    assert sched.admit() == [] and live in sched.waiting
    sched.active = busy[:1]
    sched.admit()
    assert sched.active == [busy[0], live] and list(sched.waiting) == [batch]


def test_admission_waits_for_audio_memory_but_an_empty_engine_admits_one() -> None:
    """Features and encoder rows of admitted requests stay within audio_memory_bytes: the next request waits
    while admitting it would pass the budget; with nothing admitted, one is admitted whatever its size."""
    sched = scheduler(audio_memory_bytes=1000, audio_token_bytes=10)
    big, small, other = ready(16, audio=150), ready(16, audio=60), ready(16, audio=50)
    for req in (big, small, other):
        sched.add(req)
    sched.admit()
    assert sched.active == [big]  # 1,500 bytes: over the budget, but the engine held nothing
    sched.finish(big)
    sched.admit()
    assert sched.active == [small] and list(sched.waiting) == [other]  # 600 + 500 would pass 1,000
    assert sched.audio_bytes == 600


def test_a_request_preempted_cap_times_is_spared_but_by_the_top_ranked_request() -> None:
    """A preemption takes the lowest-ranked request below the one in need; after PREEMPT_CAP preemptions a
    request is no longer a victim, except of the top-ranked running request (which must always go on)."""

    def full_pool(preempted: int) -> tuple[Scheduler, Request, Request, Request]:
        sched = scheduler(blocks=3, block=16)
        reqs = top, middle, victim = ready(16), ready(16), ready(16)
        for req in reqs:
            assert sched.blocks.grow(req, 16)
            req.prefilled = 16
            sched.active.append(req)
        victim.preempted = ["decode"] * preempted
        return sched, top, middle, victim

    sched, top, middle, victim = full_pool(PREEMPT_CAP - 1)
    assert sched._reserve(middle, 32, StepPlan([], [], []))
    assert victim not in sched.active and len(victim.preempted) == PREEMPT_CAP and sched.waiting[0] is victim
    sched, top, middle, victim = full_pool(PREEMPT_CAP)
    assert not sched._reserve(middle, 32, StepPlan([], [], []))  # spared: middle waits
    assert victim in sched.active and sched.preemptions == 0
    assert sched._reserve(top, 32, StepPlan([], [], []))  # the top-ranked request may take it
    assert victim not in sched.active and sched.preemptions == 1


def test_a_preempted_request_resumes_with_its_tokens_as_prefill_inputs() -> None:
    """A request preempted while decoding keeps its tokens: they follow its prompt in prefill_ids, on the same
    chunk grid, and it needs room for all of them before it is admitted again."""
    sched = scheduler(blocks=4, block=16)
    old, young = ready(20), ready(20)
    for req in (old, young):
        assert sched.blocks.grow(req, 22)
        req.prefilled = 20
        req.output = [5, 6]
        sched.active.append(req)
    assert sched._reserve(old, 40, StepPlan([], [], []))
    assert young.preempted == ["decode"] and young.resumed == 2 and young.output == [5, 6]
    assert young.prefill_ids == [1] * 20 + [5, 6] and young.prefill_len == 22 and not young.prefill_done
    assert young.ready_until(0) == 22 and young.context == 22
    assert sched._needs(young) == 2


def test_encoder_slices_are_whole_windows_when_live_windows_fill_the_budget() -> None:
    """Encoder-only requests past the whole budget leave the other requests' slices positive whole windows
    (or none) in every kind of step."""
    sched = scheduler()
    sched.encoding = [Request(RequestSpec([], 0), audio_tokens=208, encode_only=True) for _ in range(4)]
    sched.active = [ready(64, audio=1040), ready(64, interactive=True, audio=1040)]
    for _ in range(BATCH_EVERY):
        plan = sched.plan()
        assert all(n > 0 and (r.encode_only or n % 104 == 0) for r, n in plan.encode), plan.encode


def test_an_engine_holds_the_audio_of_one_request_at_a_time_under_a_tiny_audio_budget(ck) -> None:  # noqa: ANN001
    """EngineConfig.audio_memory_bytes reaches the scheduler: with a budget below one request's audio, requests
    run one at a time (an engine with nothing admitted admits one) and all finish."""
    from conftest import noise, prompt_for

    from qasr.engine.engine import Engine, EngineConfig

    with Engine(ck, EngineConfig(audio_memory_bytes=1)) as engine:
        sched = engine.core.scheduler
        plan = sched.plan
        running: list[int] = []

        def recording_plan():  # noqa: ANN202
            running.append(len(sched.active))
            return plan()

        sched.plan = recording_plan
        waves = [noise(1.0 + k, seed=80 + k) for k in range(3)]
        futures = [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w, ignore_eos=True)) for w in waves]
        assert all(len(f.result(60).token_ids) == 4 for f in futures)
    assert max(running) == 1 and sched.config.audio_memory_bytes == 1 and sched.config.audio_token_bytes > 0
