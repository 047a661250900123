"""Admission shares the running set between callers (``submit(group=...)``): a short request submitted behind
a long file's queued segments starts at the next free place instead of after all of them; within a group
the queue order holds; the tokens never depend on the place in line."""

from __future__ import annotations

from collections import Counter, deque

from conftest import noise, prompt_for

from qasr.engine.engine import Engine, EngineConfig
from qasr.engine.request import Request
from qasr.engine.scheduler import _by_group, _next_group

FILE = "a long file"


def behind_a_file(ck, group: object | None) -> tuple[list[int], int, int]:  # noqa: ANN001
    """30 segments of one file queued (2 run at once), then one short request in ``group``: its tokens, the
    steps from its submit to its end, and the steps the whole file took."""
    with Engine(ck, EngineConfig(max_running=2)) as engine:
        wave = noise(2.0, seed=1)
        segments = [engine.submit(prompt_for(ck, wave), waveform=wave, max_new_tokens=12, ignore_eos=True, group=FILE)
                     for _ in range(30)]
        while engine.steps < 2:  # the file is under way
            pass
        short = noise(1.0, seed=2)
        at = engine.steps
        result = engine.submit(prompt_for(ck, short), waveform=short, max_new_tokens=6, ignore_eos=True,
                               group=group).result(timeout=120)
        took = engine.steps - at
        for f in segments:
            f.result(timeout=300)
        return result.token_ids, took, engine.steps


def test_a_short_request_does_not_wait_for_a_long_files_queue(ck) -> None:  # noqa: ANN001
    tokens, took, total = behind_a_file(ck, group=None)  # a caller of its own
    same, same_took, _ = behind_a_file(ck, group=FILE)  # as if it were the file's next segment
    assert tokens == same  # its place in line changes, not its tokens
    # the next free place: a running segment ends within ~13 steps, then its encode, prefill and 6 tokens
    assert took <= 24, (took, total)
    assert same_took > 3 * took, (same_took, took, total)  # behind the file's queue, it waits for all of it


def _waiting(*groups: object) -> deque[Request]:
    return deque(Request(prompt=[1], max_new_tokens=1, group=g) for g in groups)


def test_the_group_with_fewest_running_goes_first_queue_order_within_a_group() -> None:
    waiting = _waiting("file", "file", "file", "http-1", "file", "http-2")
    queues = _by_group(waiting)
    assert list(queues) == ["file", "http-1", "http-2"]  # groups in order of their first request
    assert [r.id for r in queues["file"]] == [waiting[i].id for i in (0, 1, 2, 4)]
    running = {"file": 2}
    assert _next_group(queues, Counter(running)) == "http-1"  # nothing running
    assert _next_group(queues, Counter({"file": 0})) == "file"  # equals: queued first
    # a preempted request goes first whatever its group runs (it was running)
    queues["http-2"][0].preempted.append("decode")
    assert _next_group(queues, Counter(running)) == "http-2"


def test_requests_without_a_group_keep_the_queue_order() -> None:
    waiting = _waiting(None, None, None)
    queues = _by_group(waiting)
    order = []
    running: Counter = Counter()
    while queues:
        key = _next_group(queues, running)
        order.append(queues[key].popleft().id)
        running[key] += 1
        if not queues[key]:
            del queues[key]
    assert order == [r.id for r in waiting]
