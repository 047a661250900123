"""Live sessions: turns cut by the VAD (pauses, the soft and hard length limits), commit / clear without
turn detection, each turn's transcript equal to the official algorithm run on that turn's audio alone,
silence that costs no decoding, bounded memory over many turns, and wire PCM ingestion."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from qasr import TranscribeOptions
from qasr.streaming import (
    LiveConfig,
    LiveSession,
    OracleStream,
    PcmIngest,
    SpeechStarted,
    SpeechStopped,
    StreamConfig,
    TurnFinal,
    TurnUpdate,
)
from tests.conftest import noise

SR = 16000


def kv_in_use(engine, timeout: float = 10.0) -> int:  # noqa: ANN001
    """KV tokens held once the engine has taken the releases queued so far (a release goes through its
    inbox, so it lands a step later than the call)."""
    import time

    deadline = time.monotonic() + timeout
    while engine.stats().kv_tokens_used and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats().kv_tokens_used


def feed(live: LiveSession, audio: np.ndarray, sizes: tuple[int, ...] = (3200, 777, 5000)) -> list:
    events, i, k = [], 0, 0
    while i < len(audio):
        piece = audio[i:i + sizes[k % len(sizes)]]
        events += live.push(piece)
        i += len(piece)
        k += 1
    return events + live.finish()


def oracle_text(asr, audio: np.ndarray, config: StreamConfig) -> str:  # noqa: ANN001
    oracle = OracleStream(asr._core.engine, asr._core.checkpoint, config)
    for i in range(0, len(audio), 512):
        oracle.push(audio[i:i + 512])
    oracle.finish()
    return oracle.results[-1].text


def check_turn_events(events: list) -> list[TurnFinal]:
    """Per turn: started before its updates, stopped before its final (only updates in between), deltas
    join to the final text, stable text only grows. Returns the finals in order."""
    finals = [e for e in events if isinstance(e, TurnFinal)]
    for final in finals:
        mine = [e for e in events if e.turn == final.turn]
        kinds = [type(e).__name__ for e in mine]
        assert kinds[-1] == "TurnFinal"
        if "SpeechStarted" in kinds:
            assert kinds[0] == "SpeechStarted"
        if "SpeechStopped" in kinds:  # sent at the pause; the steps up to the turn's chunk boundary may follow
            stopped = kinds.index("SpeechStopped")
            assert set(kinds[stopped + 1:-1]) <= {"TurnUpdate"}
        updates = [e for e in mine if isinstance(e, TurnUpdate)]
        for a, b in zip(updates, updates[1:], strict=False):
            assert b.update.stable_text.startswith(a.update.stable_text)
        assert "".join(e.delta for e in updates) + final.delta == final.text
    assert [f.turn for f in finals] == list(range(len(finals)))
    return finals


def test_pauses_cut_turns_and_each_turn_is_the_official_algorithm_on_its_audio(demo, demo_clips) -> None:  # noqa: ANN001
    gap = np.zeros(SR, dtype=np.float32)
    audio = np.concatenate([gap, demo_clips[0], gap, demo_clips[1], gap, demo_clips[2], gap])
    live = demo.live(LiveConfig(StreamConfig(chunk_size_sec=1.0)))
    events = feed(live, audio)
    finals = check_turn_events(events)
    assert len(finals) == 3 and all(f.reason == "pause" for f in finals)
    starts = [e.at for e in events if isinstance(e, SpeechStarted)]
    stops = [e.at for e in events if isinstance(e, SpeechStopped)]
    assert len(starts) == len(stops) == 3
    for k, final in enumerate(finals):
        clip_start = (1 + k) + sum(len(c) for c in demo_clips[:k]) / SR  # where clip k starts in the stream
        assert clip_start - 0.5 < final.start < clip_start + 0.5
        assert final.start <= starts[k] and stops[k] < final.end
        turn_audio = audio[round(final.start * SR):round(final.end * SR)]
        assert final.text == oracle_text(demo, turn_audio, StreamConfig(chunk_size_sec=1.0))
        offline = demo.transcribe(demo_clips[k], TranscribeOptions(sample_rate=SR, segmentation="none"))[0].text
        assert final.text == offline


def test_a_paused_turn_ends_at_its_chunk_boundary_without_a_tail_step(demo, demo_clips, monkeypatch) -> None:  # noqa: ANN001
    """end_on_chunk (the default): a turn that a pause ends takes the silent frames after the pause up to
    its chunk boundary, so its last step is a chunk step and it never runs a tail step (which, without the
    option, can follow the last chunk's step in the same push); it is still the official algorithm on its
    audio. Speech coming back first ends it at once, before that frame, with a tail step as without it."""
    chunk = 2.0
    samples = int(chunk * SR)
    long_gap = np.zeros(3 * SR, dtype=np.float32)  # room to reach any boundary
    short_gap = np.zeros(int(0.7 * SR), dtype=np.float32)  # the pause is found 0.5 s in, speech is back 0.2 s later
    audio = np.concatenate([long_gap, demo_clips[0], long_gap, demo_clips[1], short_gap, demo_clips[2], long_gap])
    real = demo._core.engine.submit
    finals_of_steps: list[bool] = []  # per decoder step of a turn: keep_kv=False marks a turn's tail step

    def submit(spec, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if spec.audio_embeds is not None:  # a turn's step (the oracle submits waveforms)
            finals_of_steps.append(not spec.continuation.keep_kv)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(demo._core.engine, "submit", submit)
    cfg = StreamConfig(chunk_size_sec=chunk)
    runs = {}
    for option in (True, False):
        finals_of_steps.clear()
        events = feed(demo.live(LiveConfig(StreamConfig(chunk_size_sec=chunk), end_on_chunk=option)), audio)
        runs[option] = (check_turn_events(events), events, list(finals_of_steps))
    on, on_events, on_steps = runs[True]
    off, _, off_steps = runs[False]
    assert len(on) == len(off) == 3 and all(f.reason == "pause" for f in on + off)
    lengths = [round((f.end - f.start) * SR) for f in on]
    # turns 0 and 2 reached their boundary in the long gaps: whole chunks, and no tail step
    assert lengths[0] % samples == 0 and lengths[2] % samples == 0
    # turn 1 met the next clip's speech first: it ended before it, later than at the pause
    assert lengths[1] % samples != 0 and off[1].end < on[1].end < on[2].start + 0.33
    for final in on:
        turn_audio = audio[round(final.start * SR):round(final.end * SR)]
        assert final.text == oracle_text(demo, turn_audio, cfg)
    # every step of a turn is a chunk step except the tail of turn 1: 3 tail steps without the option
    assert sum(on_steps) == 1 and sum(off_steps) == 3
    assert len(on_steps) == sum(-(-n // samples) for n in lengths)
    # SpeechStopped comes at the pause, as without the option
    stops = [e.at for e in on_events if isinstance(e, SpeechStopped)]
    without = LiveConfig(StreamConfig(chunk_size_sec=chunk), end_on_chunk=False)
    assert stops == [e.at for e in feed(demo.live(without), audio) if isinstance(e, SpeechStopped)]


def test_commit_finish_and_clear_while_a_paused_turn_waits_for_its_boundary(demo, demo_clips) -> None:  # noqa: ANN001
    """A turn that a pause ended but that has not reached its chunk boundary yet: commit() and finish() end it
    at once (its final is the official algorithm on the audio it took), clear() drops it; nothing stays held."""
    cfg = StreamConfig(chunk_size_sec=2.0)
    gap, pause = np.zeros(SR // 2, dtype=np.float32), np.zeros(int(0.6 * SR), dtype=np.float32)
    audio = np.concatenate([gap, demo_clips[0], pause])
    for end in ("commit", "finish", "clear"):
        live = demo.live(LiveConfig(StreamConfig(chunk_size_sec=2.0)))
        events = live.push(audio)
        assert any(isinstance(e, SpeechStopped) for e in events)
        assert not any(isinstance(e, TurnFinal) for e in events) and live.in_turn  # waiting for the boundary
        if end == "clear":
            live.clear()
            assert not live.in_turn and live.push(np.zeros(3 * SR, dtype=np.float32)) == []
            live.close()
        else:
            finals = [e for e in getattr(live, end)() if isinstance(e, TurnFinal)]
            assert len(finals) == 1 and finals[0].reason == "pause"
            assert round((finals[0].end - finals[0].start) * SR) % (2 * SR) != 0  # ended before the boundary
            turn_audio = audio[round(finals[0].start * SR):round(finals[0].end * SR)]
            assert finals[0].text == oracle_text(demo, turn_audio, cfg)
        assert kv_in_use(demo._core.engine) == 0


def test_silence_starts_no_turn_and_costs_no_decoding(demo) -> None:  # noqa: ANN001
    quiet = (noise(20.0, seed=3) * 1e-4).astype(np.float32)
    before = demo._core.engine.stats().steps
    live = demo.live()
    assert feed(live, quiet) == []
    assert live.turns == 0 and live.position == len(quiet)
    assert demo._core.engine.stats().steps == before


def test_long_speech_is_cut_at_a_pause_past_soft_turn_s_and_hard_at_max_turn_s(demo, demo_clips) -> None:  # noqa: ANN001
    short_gap = np.zeros(int(0.2 * SR), dtype=np.float32)  # shorter than silence_ms: no end of turn
    speech = np.concatenate([demo_clips[0], short_gap, demo_clips[1], short_gap, demo_clips[2]])
    soft = feed(demo.live(LiveConfig(StreamConfig(chunk_size_sec=1.0), soft_turn_s=2.0)), speech)
    finals = check_turn_events(soft)
    assert finals[0].reason == "long" and 2.0 <= finals[0].end - finals[0].start < 4.0
    hard = feed(demo.live(LiveConfig(StreamConfig(chunk_size_sec=1.0), soft_turn_s=1.5, max_turn_s=1.5)), demo_clips[2])
    finals = check_turn_events(hard)
    assert finals[0].reason == "max" and finals[0].end - finals[0].start == pytest.approx(1.5, abs=0.04)
    # the next turn starts where the cut one ended, announced at once
    started = [e for e in hard if isinstance(e, SpeechStarted)]
    assert started[1].turn == 1 and started[1].at == pytest.approx(finals[0].end)


def test_commit_clear_and_finish_without_turn_detection(tiny_asr) -> None:  # noqa: ANN001
    cfg = StreamConfig(chunk_size_sec=1.0, max_new_tokens=4)
    live = LiveSession(tiny_asr._core.engine, tiny_asr._core.checkpoint, LiveConfig(stream=cfg, turn_detection=False))
    a, b, c = noise(2.3, seed=1), noise(1.0, seed=2), noise(1.7, seed=4)
    events = live.push(a) + live.commit()
    first = [e for e in events if isinstance(e, TurnFinal)]
    assert len(first) == 1 and first[0].reason == "commit" and first[0].end == pytest.approx(2.3)
    assert first[0].text == oracle_text(tiny_asr, a, cfg)
    assert live.commit() == []  # nothing left to commit
    live.push(b)
    live.clear()  # drops b: no final for it
    events = live.push(c) + live.finish()
    last = [e for e in events if isinstance(e, TurnFinal)]
    assert len(last) == 1 and last[0].reason == "finish" and last[0].turn == 2  # the cleared turn was 1
    assert last[0].start == pytest.approx(3.3) and last[0].text == oracle_text(tiny_asr, c, cfg)
    assert not any(isinstance(e, SpeechStarted | SpeechStopped) for e in events)
    with pytest.raises(RuntimeError, match="closed"):
        live.push(a)


def test_an_hour_like_stream_stays_bounded(tiny_asr) -> None:  # noqa: ANN001
    """Turns of max_turn_s one after another: the sample buffer is never reallocated, the engine holds
    no KV once the session finished, and a step's work does not grow from turn to turn."""
    cfg = LiveConfig(stream=StreamConfig(chunk_size_sec=1.0, max_new_tokens=2), turn_detection=False,
                     soft_turn_s=3.0, max_turn_s=3.0)
    live = LiveSession(tiny_asr._core.engine, tiny_asr._core.checkpoint, cfg)
    buffer, capacity = live._buffer, live._buffer.capacity
    audio = noise(45.0, seed=5)
    finals = [e for e in feed(live, audio, (16000,)) if isinstance(e, TurnFinal)]
    assert len(finals) == 15 and all(f.reason == "max" for f in finals[:-1])
    assert live._buffer is buffer and buffer.capacity == capacity
    assert kv_in_use(tiny_asr._core.engine) == 0


def test_carry_context_hands_committed_text_to_the_next_turn(tiny_asr) -> None:  # noqa: ANN001
    cfg = LiveConfig(stream=StreamConfig(chunk_size_sec=1.0, max_new_tokens=3, context="names: Ada"),
                     turn_detection=False, carry_context=True, carried_chars=40)
    live = LiveSession(tiny_asr._core.engine, tiny_asr._core.checkpoint, cfg)
    assert live.next_context == "names: Ada"
    texts = []
    for seed in (1, 2, 3):
        texts += [e.text for e in live.push(noise(1.5, seed=seed)) + live.commit() if isinstance(e, TurnFinal)]
    carried = " ".join(t for t in texts if t)[-40:]
    assert live.next_context == (f"names: Ada\n{carried}" if carried else "names: Ada")


def test_asr_live_takes_a_live_config(tiny_asr) -> None:  # noqa: ANN001
    cfg = LiveConfig(StreamConfig(chunk_size_sec=0.5, language="English"), silence_ms=800, turn_detection=False)
    live = tiny_asr.live(cfg)
    assert live.config is cfg
    assert tiny_asr.live().config == LiveConfig()
    with pytest.raises(TypeError):
        LiveConfig(no_such_setting=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="soft_turn_s"):
        LiveConfig(soft_turn_s=90.0)


# ------------------------------------------------------------------------------------------- ingest
@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
def test_pcm16_ingest_does_not_depend_on_how_bytes_were_split(rate: int) -> None:
    wave = np.sin(np.arange(rate * 2) * 2 * np.pi * 440 / rate) * 0.5
    pcm = (wave * 32767).astype("<i2").tobytes()
    whole = PcmIngest("pcm16", rate)
    one = np.concatenate([whole.feed(pcm), whole.flush()])
    split = PcmIngest("pcm16", rate)
    parts, i = [], 0
    for size in [1, 3, 1001, 4800, 7] * 1000:  # odd sizes split samples across messages
        if i >= len(pcm):
            break
        parts.append(split.feed(pcm[i:i + size]))
        i += size
    two = np.concatenate([*parts, split.flush()])
    np.testing.assert_array_equal(one, two)
    assert abs(len(one) - 2 * SR) <= 1
    expected = soxr.resample(wave.astype(np.float32), rate, SR) if rate != SR else wave
    middle = slice(SR // 2, SR + SR // 2)  # away from the resampler's edges
    np.testing.assert_allclose(one[middle], expected[middle], atol=2e-3)


def test_float32_ingest_and_bad_input() -> None:
    x = np.linspace(-1, 1, 1000, dtype="<f4")
    np.testing.assert_array_equal(PcmIngest("float32").feed(x.tobytes()), x)
    with pytest.raises(ValueError, match="NaN"):
        PcmIngest("float32").feed(np.array([np.nan], dtype="<f4").tobytes())
    with pytest.raises(ValueError, match="format"):
        PcmIngest("mp3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sample rate"):
        PcmIngest("pcm16", 100)


def test_turns_do_not_depend_on_how_the_audio_was_pushed(demo, demo_clips) -> None:  # noqa: ANN001
    gap = np.zeros(SR // 2 + 1234, dtype=np.float32)
    audio = np.concatenate([gap, demo_clips[1], gap, demo_clips[0], gap])
    cfg = LiveConfig(StreamConfig(chunk_size_sec=1.0))
    small = feed(demo.live(cfg), audio, (320,))  # 20 ms packets, as WebRTC sends them
    large = feed(demo.live(cfg), audio, (16000 * 3 + 77,))
    assert small == large and len([e for e in small if isinstance(e, TurnFinal)]) == 2


def test_concurrent_sessions_batch_their_encoder_calls_and_get_the_same_tokens(tiny_asr) -> None:  # noqa: ANN001
    """8 sessions on 8 threads share one engine: their open windows go through the engine's packed encoder
    calls (encoder-only requests) and their decoder steps through shared batches, every step is token for
    token what the session gives alone, and only the engine's thread runs the model's encoder."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from qasr.streaming import Session

    cfg = StreamConfig(chunk_size_sec=1.0, max_new_tokens=3)
    streams = [noise(12.0 + k, seed=20 + k) for k in range(8)]

    def run(audio: np.ndarray) -> list:
        session = Session(tiny_asr._core.engine, tiny_asr._core.checkpoint, cfg, record=True)
        for i in range(0, len(audio), 4000):
            session.push(audio[i:i + 4000])
        session.finish()
        return session.results

    alone = [run(a) for a in streams]
    engine = tiny_asr._core.engine
    tower = engine.prepared.model.audio_tower
    threads: list[str] = []  # the thread of every encoder call
    real = tower.encode
    tower.encode = lambda *a, **k: (threads.append(threading.current_thread().name), real(*a, **k))[1]
    submitted, calls = [], engine.core.encoder_calls
    real_submit = engine.submit_encode
    engine.submit_encode = lambda *a, **k: (submitted.append(1), real_submit(*a, **k))[1]
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(run, streams))
    finally:
        del tower.encode, engine.submit_encode
    assert together == alone
    assert len(submitted) > engine.core.encoder_calls - calls  # some encoder calls packed several sessions' windows
    assert threads and set(threads) == {"qasr-engine"}, set(threads)  # no session thread touched the model
    assert kv_in_use(tiny_asr._core.engine) == 0
