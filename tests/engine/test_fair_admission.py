"""Admission shares the running set between callers (``submit(group=...)``): a short request submitted behind
a long file's queued segments starts at the next free place instead of after all of them; within a group
the queue order holds; the tokens never depend on the place in line."""

from __future__ import annotations

from collections import Counter, deque

from conftest import DEMO, one_behind_a_queue

from qasr import TranscribeOptions
from qasr.engine.engine import EngineConfig
from qasr.engine.request import Request, RequestSpec
from qasr.engine.scheduler import _by_group, _next_group

FILE = "a long file"


def behind_a_file(ck, group: object | None) -> tuple[list[int], int, int]:  # noqa: ANN001
    """30 segments of one file queued (2 run at once), then one short request in ``group``: its tokens, the
    steps from its submit to its end, and the steps the whole file took."""
    return one_behind_a_queue(ck, EngineConfig(max_running=2), 30, 2.0, 12, queued_kwargs={"group": FILE},
                              late_kwargs={"group": group})


def test_a_short_request_does_not_wait_for_a_long_files_queue(ck) -> None:  # noqa: ANN001
    tokens, took, total = behind_a_file(ck, group=None)  # a caller of its own
    same, same_took, _ = behind_a_file(ck, group=FILE)  # as if it were the file's next segment
    assert tokens == same  # its place in line changes, not its tokens
    # the next free place: a running segment ends within ~13 steps, then its encode, prefill and 6 tokens
    assert took <= 24, (took, total)
    assert same_took > 3 * took, (same_took, took, total)  # behind the file's queue, it waits for all of it


def _waiting(*groups: object) -> deque[Request]:
    return deque(Request(RequestSpec([1], 1, group=g)) for g in groups)


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


def test_the_server_gives_each_uploads_pieces_one_group_of_their_own() -> None:
    """The server's side of the sharing: every piece of one upload is submitted in one group, and two uploads
    in two groups (one file's 200 segments must not count as 200 callers, nor two uploads as one)."""
    from concurrent.futures import Future

    import numpy as np

    from qasr.server.work import EngineRun, Upload
    from qasr.transcribe.pieces import Piece

    class Recorder:  # stands in for the ASR: EngineRun only submits
        def __init__(self) -> None:
            self.groups: list[object] = []

        def submit(self, piece: Piece, words: bool = False, on_token=None, group=None,
                   lead=False) -> Future:  # noqa: ANN001
            self.groups.append(group)
            return Future()

    def upload(pieces: int) -> Upload:
        return Upload("clip", float(pieces), tuple(
            Piece("clip", 0, float(k), 1.0, np.zeros(16000, np.float32), (1, 2), None, 8) for k in range(pieces)))

    asr = Recorder()
    EngineRun(asr, upload(3), stream=False)  # type: ignore[arg-type]
    EngineRun(asr, upload(2), stream=False)  # type: ignore[arg-type]
    first, second = asr.groups[:3], asr.groups[3:]
    assert first[0] is not None and first.count(first[0]) == 3
    assert second.count(second[0]) == 2 and second[0] is not first[0]


def test_each_transcribe_call_is_one_group() -> None:
    """ASR's side: a call's pieces (every input's) share one group; the next call gets another."""
    import numpy as np

    from qasr import ASR

    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32")
    try:
        groups: list[object] = []
        submit = asr._core.engine.submit

        def recording(spec, **kwargs):  # noqa: ANN001, ANN202 - Engine.submit's own signature
            groups.append(spec.group)
            return submit(spec, **kwargs)

        asr._core.engine.submit = recording  # type: ignore[method-assign]
        rng = np.random.default_rng(0)
        clips = [(0.1 * rng.standard_normal(16000 * s).astype(np.float32), 16000) for s in (1, 2)]
        asr.transcribe(clips, TranscribeOptions(segmentation="none"))
        first = list(groups)
        asr.transcribe(clips[:1], TranscribeOptions(segmentation="none"))
    finally:
        asr.close()
    assert len(first) == 2 and first[0] is not None and first[0] == first[1]
    assert groups[2] is not None and groups[2] != first[0]
