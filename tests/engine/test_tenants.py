"""No tenant breaks another: a consumer whose event loop closed, an aligner closed under
a transcription, a cancelled request deep in the queue, settings that cannot make progress, a device that
fails every request, and Ctrl-C inside ``with Engine(...)`` each cost only what they own."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from conftest import noise, prompt_for

from qasr import ASR, Aligner
from qasr.engine.engine import Continuation, Engine, EngineConfig, RequestSpec
from qasr.engine.errors import EngineBroken, EngineClosed
from qasr.model.checkpoint import load_checkpoint
from qasr.testing.checkpoint import make_tiny_aligner_checkpoint
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
KV = 64 << 20
SR = 16000




class StepGate:
    """Wraps ``engine.step`` so the test decides when each step runs: paused, a step waits for a permit
    (``run``); opened, steps run freely. ``blocked`` is true while the loop waits at the gate."""

    def __init__(self, engine: Engine, paused: bool = True) -> None:
        self._step = engine.core.step
        self._cond = threading.Condition()
        self.allowed = self.started = self.finished = 0
        self.opened = not paused
        self.blocked = False
        engine.core.step = self.step  # the loop calls self.step(): the instance attribute wins

    def step(self) -> None:
        with self._cond:
            self.blocked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.opened or self.started < self.allowed)
            self.blocked = False
            self.started += 1
        try:
            self._step()
        finally:
            with self._cond:
                self.finished += 1
                self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self.opened = False
            self.allowed = self.started

    def open(self) -> None:
        with self._cond:
            self.opened = True
            self._cond.notify_all()

    def wait_blocked(self, timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.blocked, timeout), "the engine never reached its next step"

    def run(self, n: int = 1, timeout: float = 60) -> None:
        """Let exactly n more steps run (the loop must be at the gate or about to be) and wait for them."""
        with self._cond:
            self.allowed = self.started + n
            goal = self.finished + n
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self.finished >= goal, timeout), "the steps did not run"


# ---------------------------------------------------------------- 1. every callback into user code is guarded
def test_a_consumer_whose_event_loop_closed_mid_stream_costs_only_its_request(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    gate = StepGate(engine, paused=False)
    wave = noise(3.0, seed=1)
    got: list[int] = []

    async def consume() -> None:
        stream = engine.tokens_async(RequestSpec(prompt_for(ck, wave), 2000, waveform=wave, ignore_eos=True))
        async for token in stream:
            got.append(token)
            if len(got) == 3:
                break
        gate.pause()
        gate.wait_blocked()  # the engine waits before its next step (so before its cancellation sweep)
        await stream.aclose()  # cancels the request; then asyncio.run closes the loop under it

    consumer = threading.Thread(target=asyncio.run, args=(consume(),))
    consumer.start()
    consumer.join(60)
    assert not consumer.is_alive() and len(got) == 3
    others = [noise(1.0 + k, seed=10 + k) for k in range(3)]
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 8, waveform=w)) for w in others]
    gate.open()  # the next step resolves the cancelled stream: its listener raises on the closed loop
    assert all(len(f.result(timeout=60).token_ids) > 0 for f in futures)
    assert not engine.stats().broken
    w = others[0]
    assert engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)).result(timeout=60).token_ids
    engine.close()


def test_close_settles_every_future_behind_a_dead_consumers_stream(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV, max_running=1))
    gate = StepGate(engine)
    long_wave = noise(2.0, seed=2)
    blocker = engine.submit(RequestSpec(prompt_for(ck, long_wave), 2000, waveform=long_wave, ignore_eos=True))
    gate.wait_blocked()  # the loop sits in a step: whatever is submitted now stays in its inbox
    wave = noise(1.5, seed=3)

    async def start_and_leave() -> None:
        stream = engine.tokens_async(RequestSpec(prompt_for(ck, wave), 50, waveform=wave))
        asyncio.ensure_future(anext(stream))  # submits; asyncio.run cancels it and closes the loop
        await asyncio.sleep(0.1)

    consumer = threading.Thread(target=asyncio.run, args=(start_and_leave(),))
    consumer.start()
    consumer.join(30)
    assert not consumer.is_alive() and engine.stats().waiting == 2  # the stream in the inbox, its loop closed
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 8, waveform=w))
               for w in (noise(1.0, seed=k) for k in range(4))]
    engine.close(drain=False, timeout=0)
    gate.open()
    for f in [blocker, *futures]:
        assert isinstance(f.exception(timeout=30), EngineClosed)


# ---------------------------------------------------------------- 2. word timestamps never hang
@pytest.fixture(scope="module")
def demo_ck():
    return load_checkpoint(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def aligner_path(tmp_path_factory) -> Path:
    return make_tiny_aligner_checkpoint(tmp_path_factory.mktemp("aligner") / "tiny", seed=1)


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> np.ndarray:
    wave, sr = sf.read(speak("set an alarm for six forty five", tmp_path_factory.mktemp("s") / "s.wav"),
                       dtype="float32")
    return soxr.resample(wave, sr, SR).astype(np.float32)


def transcribe_in_thread(asr: ASR, audio: tuple) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(asr.transcribe(audio, timestamps="word")), daemon=True)
    thread.start()
    return thread, out


def test_an_aligner_closed_under_a_transcription_fails_it_instead_of_hanging(demo_ck, aligner_path,
                                                                               sentence) -> None:
    asr = ASR(demo_ck, aligner=Aligner.from_pretrained(aligner_path, device="cpu", dtype="float32"))
    try:
        gate = StepGate(asr._core.engine)
        thread, out = transcribe_in_thread(asr, (sentence, SR))
        gate.wait_blocked()  # the piece is in the ASR engine
        asr._core.aligner.close()
        gate.open()
        thread.join(60)
        assert not thread.is_alive(), "the transcription hung on a closed aligner"
        [r] = out[0]
        assert not r.ok and "aligner" in r.error and "closed" in r.error
    finally:
        asr.close()


def test_an_alignment_failed_by_its_engines_close_fails_the_transcription(demo_ck, aligner_path, sentence) -> None:
    # small prefill chunks: the alignment takes several steps, so the one in flight at close does not finish it
    config = EngineConfig(step_tokens=16, prefill_chunk=16, kv_cache_bytes=KV)
    asr = ASR(demo_ck, aligner=Aligner.from_pretrained(aligner_path, device="cpu", dtype="float32",
                                                       engine_config=config))
    try:
        gate = StepGate(asr._core.aligner.engine)
        thread, out = transcribe_in_thread(asr, (sentence, SR))
        gate.wait_blocked()  # the piece's alignment request is in the aligner's engine
        asr._core.aligner.engine.close(drain=False, timeout=0)
        gate.open()
        thread.join(60)
        assert not thread.is_alive()
        [r] = out[0]
        assert not r.ok and "aligner" in r.error
    finally:
        asr.close()


# ---------------------------------------------------------------- 3. cancelled requests leave the queue at once
def test_a_cancelled_request_deep_in_the_queue_is_gone_after_one_step(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV, max_running=1, prefill_chunk=64, step_tokens=64))
    kept_wave = noise(10.0, seed=4)
    kept_prompt = prompt_for(ck, kept_wave)
    lease = engine.submit(RequestSpec(kept_prompt, 2, waveform=kept_wave,
                                      continuation=Continuation(keep_kv=True))).result(timeout=60).kv
    assert lease is not None
    gate = StepGate(engine)
    long_wave = noise(2.0, seed=5)
    blocker = engine.submit(RequestSpec(prompt_for(ck, long_wave), 2000, waveform=long_wave, ignore_eos=True))
    gate.wait_blocked()
    waves = [noise(1.0, seed=100 + k) for k in range(40)]
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)) for w in waves[:20]]
    victim_wave = noise(1.0, seed=7)
    ended: list = []
    victim = engine.submit(RequestSpec(prompt_for(ck, victim_wave), 4, waveform=victim_wave), on_token=ended.append)
    continuing = engine.submit(RequestSpec(kept_prompt, 4, waveform=kept_wave,
                                           continuation=Continuation(kv_prefix=(lease, 128))))
    futures += [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)) for w in waves[20:]]
    gate.run(1)  # the step in flight; then the loop takes the inbox: all 42 wait behind the running one
    gate.wait_blocked()
    assert len(engine.core.scheduler.waiting) == 42
    victim_ref = weakref.ref(next(r for r in engine.core.scheduler.waiting if r.future is victim).features)
    used = engine.stats().kv_tokens_used
    kept = len(lease.blocks) * engine.stats().kv_block_tokens  # the lease's blocks are emptied when freed
    assert victim.cancel() and continuing.cancel()
    assert victim_ref() is not None  # the engine still holds the cancelled request's features
    gate.run(1)
    assert len(engine.core.scheduler.waiting) == 40
    assert victim_ref() is None  # its features are freed
    assert ended == [None]  # its stream was closed
    assert kept and engine.stats().kv_tokens_used == used - kept  # the kept blocks went back to the pool
    blocker.cancel()
    gate.open()
    assert all(f.result(timeout=120).token_ids for f in futures)
    engine.close()


# ---------------------------------------------------------------- 4. settings that cannot make progress
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_running=0), "max_running"),
    (dict(max_running=-3), "max_running"),
    (dict(step_tokens=0), "step_tokens"),
    (dict(step_tokens=True), "step_tokens"),
    (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(conv_batch=0), "conv_batch"),
    (dict(max_running=2.5), "max_running"),
    (dict(kv_cache_bytes=-1), "kv_cache_bytes"),
    (dict(audio_memory_bytes=-1), "audio_memory_bytes"),
    (dict(audio_memory_bytes=True), "audio_memory_bytes"),
    (dict(step_tokens=200, prefill_chunk=201), "prefill_chunk"),
    (dict(step_tokens=128, prefill_chunk=256), "at most step_tokens"),
])
def test_settings_that_cannot_make_progress_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_the_settings_in_use_still_construct() -> None:
    EngineConfig()
    EngineConfig(kv_cache_bytes=1)  # the smallest cache the engine makes
    EngineConfig(kv_cache_bytes=0)  # the default size, like None
    EngineConfig(kv_cache_bytes=np.int64(1 << 20), max_running=np.int64(4))
    EngineConfig(max_running=1, step_tokens=300)
    EngineConfig(step_tokens=4 * 780)
    EngineConfig(step_tokens=200, prefill_chunk=32)  # the aligner parity test's
    EngineConfig(prefill_chunk=64, step_tokens=128)
    EngineConfig(kv_cache_bytes=None, max_running=64, step_tokens=120 * 104 + 16384 + 64, prefill_chunk=2048,
                 conv_batch=256)  # bench/gpu.py
    EngineConfig(step_tokens=200, prefill_chunk=200)  # the edge: a chunk of a whole step's budget still progresses


def test_a_chunk_at_the_limit_still_finishes_long_audio(ck) -> None:
    wave = noise(30.0, seed=8)  # 390 audio tokens: far beyond the encoder's lookahead of step_tokens
    with Engine(ck, EngineConfig(kv_cache_bytes=KV, step_tokens=128, prefill_chunk=128)) as e:
        assert len(e.submit(RequestSpec(prompt_for(ck, wave), 3, waveform=wave,
                                        ignore_eos=True)).result(timeout=120).token_ids) == 3


# ---------------------------------------------------------------- 5. a device that fails every request
def test_a_step_where_every_request_fails_alone_breaks_the_engine(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))

    def failing(plan):  # noqa: ANN001, ANN202 - a sticky device error
        raise RuntimeError("device lost")

    engine.core.runner.forward = failing
    gate = StepGate(engine)
    waves = [noise(1.0 + k, seed=20 + k) for k in range(4)]
    first = engine.submit(RequestSpec(prompt_for(ck, waves[0]), 4, waveform=waves[0]))
    gate.wait_blocked()
    rest = [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)) for w in waves[1:]]
    gate.run(1)  # the first request's step, alone: it fails, and one request failing is no proof of a device
    with pytest.raises(RuntimeError, match="device lost"):
        first.result(timeout=30)
    assert not engine.stats().broken
    gate.open()  # the three share the next step, and each fails alone too
    for f in rest:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(timeout=30)
    deadline = time.monotonic() + 30
    while not engine.stats().broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().broken
    with pytest.raises(EngineBroken, match="failed alone"):
        engine.submit(RequestSpec(prompt_for(ck, waves[0]), 4, waveform=waves[0]))
    engine.close()


def test_requests_that_each_fail_for_their_own_data_keep_the_engine(ck) -> None:
    """Every request of a step failing alone with a ValueError (its own data, e.g. non-finite audio rows)
    fails those requests only: the engine is not broken and serves the next one."""
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    forward = engine.core.runner.forward
    bad = {len(prompt_for(ck, noise(1.0 + k, seed=40 + k))) for k in range(3)}

    def refusing(plan):  # noqa: ANN001, ANN202
        if any(len(r.prompt) in bad for r in plan.requests):
            raise ValueError("audio rows hold NaN")
        return forward(plan)

    engine.core.runner.forward = refusing
    gate = StepGate(engine)
    waves = [noise(1.0 + k, seed=40 + k) for k in range(3)]
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)) for w in waves]
    gate.wait_blocked()
    gate.open()
    for f in futures:
        with pytest.raises(ValueError, match="NaN"):
            f.result(timeout=30)
    assert not engine.stats().broken
    good = noise(4.5, seed=49)
    assert len(engine.submit(RequestSpec(prompt_for(ck, good), 2, waveform=good,
                                         ignore_eos=True)).result(timeout=30).token_ids) == 2
    engine.close()


def test_a_step_where_one_request_fails_keeps_the_engine(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=KV))
    waves = [noise(1.0 + k, seed=30 + k) for k in range(3)]
    culprit = len(prompt_for(ck, waves[1]))
    forward = engine.core.runner.forward

    def faulty(plan):  # noqa: ANN001, ANN202
        if any(len(r.prompt) == culprit for r in plan.requests):
            raise RuntimeError("bad request")
        return forward(plan)

    engine.core.runner.forward = faulty
    gate = StepGate(engine)
    engine.submit(RequestSpec(prompt_for(ck, waves[2]), 2, waveform=waves[2]))
    gate.wait_blocked()
    futures = [engine.submit(RequestSpec(prompt_for(ck, w), 4, waveform=w)) for w in waves]
    gate.open()
    with pytest.raises(RuntimeError, match="bad request"):
        futures[1].result(timeout=60)
    assert futures[0].result(timeout=60).token_ids and futures[2].result(timeout=60).token_ids
    assert not engine.stats().broken
    assert engine.submit(RequestSpec(prompt_for(ck, waves[0]), 2, waveform=waves[0])).result(timeout=60)
    engine.close()


# ---------------------------------------------------------------- 6. leaving `with Engine` on an exception
CHILD = textwrap.dedent("""
    import json, signal, sys, time
    import numpy as np
    from qasr.engine.engine import Engine, EngineConfig, RequestSpec
    from qasr.model.checkpoint import load_checkpoint
    from qasr.model.config import audio_token_count
    from qasr.model.prompt import build_prompt

    # Ctrl-C as at a terminal even where this test runs with SIGINT ignored (a background job of a
    # non-interactive shell passes SIG_IGN on, and Python keeps an ignored SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ck = load_checkpoint(sys.argv[1], device="cpu", dtype="float32")
    wave = (0.1 * np.random.default_rng(0).standard_normal(3 * 16000)).astype(np.float32)
    prompt = build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160), "")
    futures = []
    try:
        with Engine(ck, EngineConfig(kv_cache_bytes=64 << 20, max_running=1)) as engine:
            futures += [engine.submit(RequestSpec(prompt, 2000, waveform=wave, ignore_eos=True)) for _ in range(100)]
            while engine.stats().generated_tokens < 5:
                time.sleep(0.01)
            started = time.monotonic()
            if sys.argv[2] == "raise":
                raise RuntimeError("boom")
            print("ready", flush=True)
            time.sleep(600)
    except (RuntimeError, KeyboardInterrupt) as exc:
        left = time.monotonic() - started
        outcomes = [type(f.exception(timeout=0)).__name__ if f.done() else "pending" for f in futures]
        print(json.dumps({"left_s": left, "caught": type(exc).__name__, "outcomes": outcomes}), flush=True)
""")


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_leaving_with_engine_on_an_exception_does_not_drain(tiny_original, tmp_path, how: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_original), how], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if how == "sigint":
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["caught"] == ("RuntimeError" if how == "raise" else "KeyboardInterrupt")
    assert report["left_s"] < 10  # not the drain of 100 x 2,000 tokens
    assert report["outcomes"] == ["EngineClosed"] * 100
