"""The whole product under both loads at once: live sessions pushing audio as fast as the engine takes it
beside files, in a KV pool too small for all of them. The files finish within a few times their time alone,
with the same text."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import DEMO

from qasr import ASR
from qasr.engine.engine import EngineConfig
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.model.checkpoint import load_checkpoint
from qasr.streaming.config import StreamConfig

SR = 16000


def spoken(clips: list[np.ndarray], seconds: float, first: int) -> np.ndarray:
    """The clips in turn from ``first``, each followed by 0.5 s of silence, cut to ``seconds``."""
    parts, n, k = [], 0, first
    while n < seconds * SR:
        clip = clips[k % len(clips)]
        parts += [clip, np.zeros(SR // 2, np.float32)]
        n += len(clip) + SR // 2
        k += 1
    return np.concatenate(parts)[:int(seconds * SR)]


@pytest.mark.slow
def test_files_finish_beside_live_sessions_pushing_without_pause_in_a_tight_pool(demo_clips) -> None:  # noqa: ANN001
    ck = load_checkpoint(DEMO, device="cpu", dtype="float32")
    asr = ASR(ck, EngineConfig(kv_cache_bytes=1500 * kv_bytes_per_token(ck.config.decoder, ck.dtype)))
    try:
        files = [(spoken(demo_clips, 30.0, k), SR) for k in range(6)]
        t0 = time.perf_counter()
        alone = [r.text for r in asr.transcribe(files)]
        alone_s = time.perf_counter() - t0
        track = spoken(demo_clips, 10.0, 0)
        stop = threading.Event()
        steps: list[int] = []

        def live() -> None:
            while not stop.is_set():
                session = asr.stream(StreamConfig(chunk_size_sec=0.5))
                for i in range(0, len(track), SR // 2):
                    if stop.is_set():
                        break
                    steps.append(len(session.push(track[i:i + SR // 2])))
                session.close()

        sessions = [threading.Thread(target=live, daemon=True) for _ in range(8)]
        for t in sessions:
            t.start()
        while len(steps) < 16:  # every session under way
            time.sleep(0.01)
        loaded: list[str] = []
        worker = threading.Thread(target=lambda: loaded.extend(r.text for r in asr.transcribe(files)), daemon=True)
        t0 = time.perf_counter()
        worker.start()
        worker.join(max(6 * alone_s, 5.0))
        loaded_s = time.perf_counter() - t0
        live_steps = len(steps)
        stop.set()
        worker.join(120)
        for t in sessions:
            t.join(60)
    finally:
        asr.close()
    assert live_steps > 40, live_steps  # the sessions kept pushing all along
    assert loaded == alone
    assert loaded_s <= max(6 * alone_s, 5.0), (loaded_s, alone_s)
