"""Encoder-only requests (Engine.submit_encode): the way live sessions encode their windows, on the engine's
thread, packed with other work, exact, refused when malformed, dropped when cancelled."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from qasr import TranscribeOptions
from qasr.audio.features import LogMel


def features(ckpt, seconds: float, seed: int) -> torch.Tensor:  # noqa: ANN001 - a Checkpoint
    wave = np.random.default_rng(seed).standard_normal(int(16000 * seconds)).astype(np.float32) * 0.1
    return LogMel(ckpt.features, "cpu")(wave)


def test_rows_equal_the_encoder_alone_while_files_share_the_step(tiny_asr) -> None:  # noqa: ANN001
    engine = tiny_asr._core.engine
    tower = engine.prepared.model.audio_tower
    feats = [features(tiny_asr._core.checkpoint, s, k) for k, s in enumerate((0.5, 3.0, 8.0, 11.0))]
    with torch.inference_mode():
        runner = engine.core.runner
        alone = [tower([f], conv_batch=runner.conv_batch, kernels=runner.kernels)[0] for f in feats]
    wave = np.random.default_rng(9).standard_normal(16000 * 20).astype(np.float32) * 0.1
    [piece] = tiny_asr._core.prepare((wave, 16000), TranscribeOptions(max_new_tokens=4))  # a file's request too
    file = tiny_asr._core.submit(piece)
    calls = engine.core.encoder_calls
    futures = [engine.submit_encode(f) for f in feats]
    rows = [f.result(timeout=60).rows for f in futures]
    file.result(timeout=60)
    for got, want in zip(rows, alone, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    assert engine.core.encoder_calls - calls <= 3  # the four rode shared calls, not one call each
    assert engine.stats().kv_blocks_used == 0  # encoder-only requests hold no KV


def test_malformed_features_are_refused_at_submit(tiny_asr) -> None:  # noqa: ANN001
    mel = tiny_asr._core.checkpoint.config.encoder.num_mel_bins
    for bad in (torch.zeros(mel + 1, 50), torch.zeros(mel, 0), torch.full((mel, 50), float("nan")), np.zeros((mel, 5))):
        with pytest.raises(ValueError):
            tiny_asr._core.engine.submit_encode(bad)


def test_a_cancelled_encode_request_is_dropped(tiny_asr) -> None:  # noqa: ANN001
    engine = tiny_asr._core.engine
    gate, entered = threading.Event(), threading.Event()
    real_step = engine.core.step

    def held_step() -> None:  # hold the engine inside a step while the test queues and cancels
        entered.set()
        gate.wait(30)
        real_step()

    wave = np.random.default_rng(3).standard_normal(16000 * 2).astype(np.float32) * 0.1
    [piece] = tiny_asr._core.prepare((wave, 16000), TranscribeOptions(max_new_tokens=2))
    engine.core.step = held_step
    try:
        busy = tiny_asr._core.submit(piece)
        assert entered.wait(30)
        doomed = engine.submit_encode(features(tiny_asr._core.checkpoint, 1.0, 5))
        kept = engine.submit_encode(features(tiny_asr._core.checkpoint, 1.0, 6))
        assert doomed.cancel()
    finally:
        gate.set()
        del engine.core.step
    busy.result(timeout=60)
    assert kept.result(timeout=60).rows.shape[0] > 0 and doomed.cancelled()
    assert not engine.core.scheduler.encoding
