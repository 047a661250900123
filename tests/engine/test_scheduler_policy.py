"""The scheduling policy on the scheduler alone: rank (live work, then age), one token budget per step (decode
rows first, then encoder and prefill work, each class's share under overload, progress when decode rows fill
it), the same room rule for every kind, the audio memory budget (and, through an engine, that its setting
reaches the scheduler) and the preemption cap."""

from __future__ import annotations

import numpy as np

from qasr.engine.kv_blocks import BlockAllocator, BlockManager
from qasr.engine.request import Continuation, Request, RequestSpec
from qasr.engine.scheduler import (
    BATCH_EVERY,
    BATCH_SHARE,
    DRAFT_ROWS,
    LEAD_HOLD_STEPS,
    PREEMPT_CAP,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)

CFG = SchedulerConfig(step_tokens=1040, prefill_chunk=128, window_tokens=104)


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


def advance(plan: StepPlan) -> None:
    """Apply a plan's encoder slices and prefill chunks (decode rows make no token here)."""
    for req, n in plan.prefill:
        req.prefilled += n
    for req, n in plan.encode:
        req.encoded_tokens += n


def decoding(n: int, interactive: bool = False) -> list[Request]:
    """``n`` requests past their prefill, each a decode row."""
    reqs = [ready(16, interactive=interactive) for _ in range(n)]
    for req in reqs:
        req.prefilled = 16
    return reqs


def work(plan: StepPlan) -> int:
    """Tokens a plan spends: decode rows (guesses included), prefill tokens and encoder rows."""
    return (len(plan.decode) + sum(len(g) for g in plan.drafts.values()) + sum(n for _, n in plan.prefill)
            + sum(n for _, n in plan.encode))


def test_under_overload_batch_work_rides_in_one_step_of_batch_every() -> None:
    """Both classes with far more ready work than a step holds: in one step of BATCH_EVERY batch work gets its
    share of the budget (BATCH_SHARE, one window and one chunk at least) and live work the rest; in the others
    live work gets the whole budget. With one class alone it gets the whole budget every step; encoder-only
    requests (live sessions' windows) are encoded whole, whatever the budget."""
    sched = scheduler()
    sched.active = [*(ready(2048, audio=1040) for _ in range(4)),
                    *(ready(2048, interactive=True, audio=1040) for _ in range(4))]
    seen = []
    for _ in range(2 * BATCH_EVERY):
        plan = sched.plan()
        seen.append(shares(plan))
        advance(plan)
    floor = 104 + 128  # a class's window and chunk, whatever is left
    share = int(1040 * BATCH_SHARE)
    for k, (lp, bp, le, be) in enumerate(seen):
        if (k + 1) % BATCH_EVERY:  # live work's steps: the whole budget (and no more than its floor beyond)
            assert bp == be == 0 and 1040 - 128 < lp + le <= 1040 + floor, seen
        else:  # batch work's: its share, one window and one chunk at least; live work the rest
            assert be >= 104 and bp >= 128 and bp + be <= share + floor, seen
            assert lp + le <= 1040 - share + floor and lp > 0 and le > 0, seen
    batch_only = scheduler()
    batch_only.active = [ready(2048, audio=1040) for _ in range(2)]
    for _ in range(BATCH_EVERY):
        plan = batch_only.plan()
        assert 1040 - 128 < work(plan) <= 1040 + 128 and shares(plan)[0] == shares(plan)[2] == 0, shares(plan)
        advance(plan)
    live_only = scheduler()
    live_only.active = [ready(2048, interactive=True) for _ in range(2)]
    live_only.encoding = [Request(RequestSpec([], 0), audio_tokens=208, encode_only=True) for _ in range(4)]
    assert shares(live_only.plan()) == (128 * 1, 0, 832, 0)  # 832 whole windows; one chunk of 128 fits in 208


def test_decode_rows_and_their_guesses_count_against_the_budget() -> None:
    """Each decode row and each guessed row takes one token of step_tokens before any encoder or prefill work;
    what they leave goes to prefill in whole chunks."""
    sched = scheduler(step_tokens=1040)
    rows = decoding(100)
    waiting = ready(4096)
    sched.active = [*rows, waiting]
    plan = sched.plan()
    assert plan.decode == rows and plan.prefill == [(waiting, 128)] * 7  # 100 + 7 * 128 = 996 of 1040
    sched = scheduler(step_tokens=1040)
    guessing = decoding(36)
    for req in guessing:
        req.spec = RequestSpec([1] * 16, 20, continuation=Continuation(draft=(7,) * 12))
    sched.active = [*guessing, ready(4096)]
    plan = sched.plan()
    assert sum(len(g) for g in plan.drafts.values()) == 36 * DRAFT_ROWS  # 36 + 288 rows: 716 left
    assert sum(n for _, n in plan.prefill) == 5 * 128 and work(plan) <= 1040


def test_a_step_whose_decode_rows_fill_the_budget_runs_them_all_and_still_moves_other_work() -> None:
    """More decode rows than step_tokens: every row runs (none is left a step behind), and each class that
    works in the step gets its floor, one window and one chunk, so encoder and prefill work never starve;
    a request waiting behind them is encoded and prefilled to its first token."""
    sched = scheduler(step_tokens=256)
    rows = decoding(300)
    newcomer = ready(300, audio=200)
    newcomer.audio_before = np.minimum(np.arange(301), 200)  # its audio first, then 100 text tokens
    sched.active = [*rows, newcomer]
    steps = 0
    while not newcomer.prefill_done:
        plan = sched.plan()
        assert plan.decode[:300] == rows  # every row, every step
        assert [n for _, n in plan.encode] in ([104], [96], []) and len(plan.prefill) <= 1, plan
        advance(plan)
        steps += 1
    assert steps <= 4, steps  # window, window + chunk, chunk, last chunk: never starved
    sched = scheduler(step_tokens=256)
    live_rows = decoding(300, interactive=True)
    batch = ready(300, audio=200)
    batch.audio_before = np.minimum(np.arange(301), 200)
    sched.active = [*live_rows, batch]
    planned = []
    while not batch.prefill_done:
        plan = sched.plan()
        planned.append(bool(plan.encode or plan.prefill))
        advance(plan)
        assert len(planned) <= 8 * BATCH_EVERY
    assert planned[BATCH_EVERY - 1::BATCH_EVERY][:2] == [True, True]  # batch work moves in each of its steps


def test_the_encoder_runs_at_most_a_budget_ahead_of_prefill() -> None:
    """A request's next slice is planned only while its encoded audio is less than step_tokens ahead of its
    prefill; its prefill then follows within the same step."""
    sched = scheduler(step_tokens=520, prefill_chunk=128)
    long = ready(2100, audio=2080)
    long.audio_before = np.minimum(np.arange(2101), 2080)
    sched.active = [long]
    for _ in range(12):
        plan = sched.plan()
        advance(plan)
        assert long.encoded_tokens - long.audio_before_position(long.prefilled) < 520 + 520, plan
    assert long.prefilled > 0


def test_work_goes_by_rank_live_first_then_age() -> None:
    """Prefill chunks go to live work first, then to the oldest request, whatever the admission order; while
    another request of its class waits for work, one takes at most half of what the decode rows leave."""
    sched = scheduler()
    old, young = ready(300), ready(300)
    live = ready(100, interactive=True)
    sched.active = [young, old, live]
    sched.planned = BATCH_EVERY - 1  # the next step is one where batch work rides beside live work
    assert sched.plan().prefill == [(live, 100), (old, 128), (old, 128)]  # batch work's share: 256 of 260
    sched = scheduler(step_tokens=512)
    sched.active = [young, old]
    assert sched.plan().prefill == [(old, 128), (old, 128), (young, 128), (young, 128)]
    sched = scheduler(step_tokens=1024)
    sched.active = [young, old]
    assert sched.plan().prefill == [(old, 128), (old, 128), (old, 44), (young, 128), (young, 128), (young, 44)]
    sched = scheduler(step_tokens=512)
    sched.active = [old]  # alone, it takes the whole budget
    assert sched.plan().prefill == [(old, 128), (old, 128), (old, 44)]


def test_a_short_request_is_not_held_behind_a_long_ones_prompt() -> None:
    """A long request that could fill every step takes at most half of it while a younger one waits for
    work: the younger one is encoded and prefilled in its first step."""
    sched = scheduler(step_tokens=1024)
    long = ready(15620, audio=15600)
    long.audio_before = np.minimum(np.arange(15621), 15600)
    sched.active = [long]
    for _ in range(3):
        advance(sched.plan())
    short = ready(46, audio=26)
    short.audio_before = np.minimum(np.arange(47), 26)
    sched.active.append(short)
    plan = sched.plan()
    assert (short, 26) in plan.encode and (short, 46) in plan.prefill, plan
    assert sum(n for r, n in [*plan.encode, *plan.prefill] if r is long) <= 512 + 128


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


def test_a_lead_holds_its_groups_work_while_the_group_has_enough_of_it() -> None:
    """While a lead is admitted and its group's other requests have LEAD_HOLD_STEPS budgets of encoder and
    prefill work left, they get none (their decode rows still run); other groups' work goes on; a group with
    less work is not held (the hold would cost more than it spares), nor one whose lead ended or waits."""
    def of_file(req: Request) -> Request:
        req.spec = RequestSpec(req.spec.prompt, 8, group="file")
        return req

    sched = scheduler(step_tokens=1024)
    lead = Request(RequestSpec([1] * 16, 8, group="file", lead=True), audio_before=np.zeros(17, dtype=np.int64))
    lead.prefilled = 16  # decoding
    mate = of_file(ready(LEAD_HOLD_STEPS * 1024))
    other, decoding_mate = ready(300), of_file(decoding(1)[0])
    sched.active = [lead, mate, decoding_mate, other]
    plan = sched.plan()
    assert plan.decode == [lead, decoding_mate]
    assert {r for r, _ in plan.prefill} == {other}
    mate.prefilled = 1  # a token less than the hold's threshold left
    assert mate in {r for r, _ in sched.plan().prefill}
    mate.prefilled = 0
    sched.active = [mate, decoding_mate, other]  # the lead is done
    assert mate in {r for r, _ in sched.plan().prefill}
    sched.waiting.append(lead)  # preempted: the group is not held behind a request that cannot run
    assert mate in {r for r, _ in sched.plan().prefill}
