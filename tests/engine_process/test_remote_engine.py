"""An engine process serves what an in-process engine serves (demo model, float32 on the CPU): the same token ids
for the same pieces (features made by the server, or waveforms the engine process turns into features itself),
tokens streamed in order and then None, large audio through shared memory that is freed, the same transcripts
and word times through the ``ASR`` facade (aligner role), a live turn's Updates equal to an in-process
``Session``'s for the same PCM, and a cancelled call aborted in the engine process, its KV freed."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qasr import ASR, TranscribeOptions
from qasr.engine.config import EngineConfig
from qasr.engine.engine import RequestSpec
from qasr.engine_process import client
from qasr.engine_process.asr import start_asr
from qasr.engine_process.child import EngineSpec
from qasr.engine_process.protocol import TurnClose
from qasr.engine_process.shared_array import SharedArray
from qasr.streaming import Session, StreamConfig
from tests.conftest import DEMO, prompt_for

DEMO_ALIGNER = DEMO.parent / "qasr-demo-aligner-en"
KV_BYTES = 64 * 2**20  # plenty for these requests; the KV pool's size changes no token
THREADS = 2  # both sides alike: the engine process would take every CPU, the tests' torch runs 2 threads


def demo_spec(**engine: object) -> EngineSpec:
    """The demo model and its aligner, float32 on the CPU, as the engine process loads them."""
    config = EngineConfig(kv_cache_bytes=KV_BYTES, threads=THREADS, **engine)  # type: ignore[arg-type]
    return EngineSpec(str(DEMO), device="cpu", dtype="float32", engine=config, aligner=str(DEMO_ALIGNER),
                      aligner_engine=EngineConfig(kv_cache_bytes=KV_BYTES, threads=THREADS))


@pytest.fixture(scope="module")
def remote() -> Iterator[ASR]:
    asr = start_asr(demo_spec(), timeout_s=60)
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def local() -> Iterator[ASR]:
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32", aligner=str(DEMO_ALIGNER),
                              engine=EngineConfig(kv_cache_bytes=KV_BYTES), threads=THREADS)
    yield asr
    asr.close()


def specs(ck, clips: list[np.ndarray]) -> list[RequestSpec]:  # noqa: ANN001 - a Checkpoint
    """One piece per clip, and the three clips as one piece of about 9 s (its features go by shared memory)."""
    waves = [*clips, np.concatenate(clips)]
    return [RequestSpec(prompt_for(ck, w), 48, waveform=w) for w in waves]


def test_the_same_tokens_as_an_in_process_engine(remote, local, demo_clips,  # noqa: ANN001
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    shared: list[SharedArray] = []
    real_share = client.share

    def recording_share(array):  # noqa: ANN001, ANN202
        sent = real_share(array)
        if isinstance(sent, SharedArray):
            shared.append(sent)
        return sent

    monkeypatch.setattr(client, "share", recording_share)
    engine, ref = remote._core.engine, local._core.engine
    pieces = specs(local._core.checkpoint, demo_clips)
    want = [f.result(120) for f in [ref.submit(s) for s in pieces]]
    got = [f.result(120) for f in [engine.submit(s) for s in pieces]]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert all(len(w.token_ids) > 3 for w in want)
    assert shared, "no piece was large enough to go through shared memory"
    assert not [s.name for s in shared if Path("/dev/shm", s.name.lstrip("/")).exists()], "blocks left behind"
    # waveforms the engine process makes features of itself (what a GPU engine does): the same tokens
    monkeypatch.setattr(engine, "log_mel", None)
    got = [f.result(120) for f in [engine.submit(s) for s in pieces]]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_streamed_tokens_arrive_in_order_then_none(remote, local, demo_clips) -> None:  # noqa: ANN001
    engine, ref = remote._core.engine, local._core.engine
    spec = specs(local._core.checkpoint, demo_clips)[1]

    def streamed(e) -> tuple[list[int | None], list[int]]:  # noqa: ANN001 - an Engine or a RemoteEngine
        seen: list[int | None] = []
        ended = threading.Event()

        def on_token(token: int | None) -> None:
            assert not ended.is_set(), "a token after the end"
            seen.append(token)
            if token is None:
                ended.set()

        result = e.submit(spec, on_token=on_token).result(120)
        assert ended.wait(10), "no None after the last token"
        return seen, result.token_ids

    seen, ids = streamed(engine)
    want, want_ids = streamed(ref)
    assert ids == want_ids and seen == want
    assert seen[-1] is None and None not in seen[:-1]
    assert seen[:len(ids)] == ids


@pytest.mark.slow
def test_transcripts_and_word_times_through_the_facade(remote, local, demo_clips) -> None:  # noqa: ANN001
    options = TranscribeOptions(sample_rate=16000, timestamps="word")
    want = local.transcribe(list(demo_clips), options)
    got = remote.transcribe(list(demo_clips), options)
    assert [t.text for t in got] == [t.text for t in want]
    assert all(t.text for t in want)
    words = [[(w.text, w.start, w.end) for s in t.segments for w in s.words] for t in got]
    assert words == [[(w.text, w.start, w.end) for s in t.segments for w in s.words] for t in want]
    assert all(words)


def test_a_remote_live_turn_gives_a_sessions_updates(remote, local, demo_clips) -> None:  # noqa: ANN001
    """The streaming algorithm through the process boundary: the same Updates, push by push, as an in-process
    Session on the same PCM (which the streaming tests hold to the re-encode-everything oracle)."""
    config = StreamConfig(chunk_size_sec=1.0, unfixed_chunk_num=2, unfixed_token_num=5, max_new_tokens=32)
    gap = np.zeros(8000, np.float32)
    audio = np.concatenate([demo_clips[0], gap, demo_clips[2]])
    turn = remote._core.engine.open_turn(config)
    session = Session(local._core.engine, local._core.checkpoint, config)
    steps = 0
    for i in range(0, len(audio), 8000 + 3000):
        piece = audio[i:i + 11000]
        mine, ref = turn.push(piece), session.push(piece)
        assert mine == ref, f"push at sample {i}"
        steps += len(ref)
    assert steps >= 5
    last, ref_last = turn.finish(), session.finish()
    assert last == ref_last and last.final and last.text
    turn.close()
    session.close()
    with pytest.raises(RuntimeError, match="finished"):
        turn.push(gap)


def test_a_cancelled_call_is_aborted_in_the_engine_process(remote, local, demo_clips) -> None:  # noqa: ANN001
    engine = remote._core.engine
    process = engine.process
    spec = RequestSpec(prompt_for(local._core.checkpoint, demo_clips[0]), 4000, waveform=demo_clips[0],
                       ignore_eos=True)
    started = threading.Event()
    seen: list[int | None] = []

    def on_token(token: int | None) -> None:
        seen.append(token)
        if len(seen) >= 3:
            started.set()

    before = wait_stats(engine, lambda s: s.running == 0)
    future = engine.submit(spec, on_token=on_token)
    assert started.wait(60), "the request never started"
    busy = wait_stats(engine, lambda s: s.running == 1 and s.kv_blocks_used > 0)
    assert future.cancel()
    after = wait_stats(engine, lambda s: s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0)
    assert busy.kv_blocks_used > 0
    # stopped long before its 4000 tokens: the abort, not its end, freed it
    assert after.generated_tokens - before.generated_tokens < 2000
    assert seen[-1] is None
    deadline = time.monotonic() + 10
    while process._pending and time.monotonic() < deadline:  # the engine process's Done for it came back
        time.sleep(0.05)
    assert not process._pending


def wait_stats(engine, condition, timeout: float = 20.0):  # noqa: ANN001, ANN201
    """The remote engine's first stats snapshot (sent several times a second) that meets ``condition``."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if not stats.broken and condition(stats):
            return stats
        assert time.monotonic() < deadline, f"stats never got there: {stats}"
        time.sleep(0.02)


def test_a_call_that_does_not_pickle_fails_alone(remote, local, demo_clips) -> None:  # noqa: ANN001
    """Its caller gets the error; the engine process's pipe and the calls after it are unharmed."""
    engine = remote._core.engine
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        engine.process.call(TurnClose(lambda: 0))  # type: ignore[arg-type]
    assert not engine.process._pending
    spec = specs(local._core.checkpoint, demo_clips)[0]
    assert engine.submit(spec).result(60).token_ids == local._core.engine.submit(spec).result(60).token_ids
