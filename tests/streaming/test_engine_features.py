"""The engine features live sessions use: a request given its encoder rows (audio_embeds) and a request
that continues the kept KV blocks of an earlier one (keep_kv / kv_prefix)."""

from __future__ import annotations

import time

import pytest
import torch

from qasr.audio.features import LogMel
from qasr.engine.engine import Continuation, RequestSpec
from qasr.model.prompt import build_prompt
from qasr.streaming.config import StreamConfig
from tests.conftest import noise


def _rows(asr, wave):  # noqa: ANN001, ANN202
    eng = asr._core.engine
    feats = LogMel(asr._core.checkpoint.features)(wave)
    with torch.inference_mode():
        return eng.prepared.model.audio_tower([feats], conv_batch=eng.core.runner.conv_batch,
                                              kernels=eng.core.runner.kernels)[0]


def _idle_kv(eng, used: int, timeout: float = 10.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while eng.stats().kv_tokens_used != used and time.monotonic() < end:
        time.sleep(0.01)
    assert eng.stats().kv_tokens_used == used


def test_kv_prefix_continues_kept_blocks(tiny_asr) -> None:  # noqa: ANN001
    eng, ck = tiny_asr._core.engine, tiny_asr._core.checkpoint
    before = eng.stats().kv_tokens_used
    long_wave = noise(30.0, seed=11)
    rows_a = _rows(tiny_asr, long_wave[: 16000 * 26])  # windows 0-2 closed, as in the longer audio
    rows_b = _rows(tiny_asr, long_wave)
    assert torch.equal(rows_a[:312], rows_b[:312])
    prompt_a = build_prompt(ck.tokenizer, ck.special, rows_a.shape[0])
    prompt_b = build_prompt(ck.tokenizer, ck.special, rows_b.shape[0])
    first = eng.submit(RequestSpec(prompt_a, 4, audio_embeds=rows_a, continuation=Continuation(keep_kv=True))).result()
    lease = first.kv
    assert lease is not None and lease.valid == len(prompt_a)
    fresh = eng.submit(RequestSpec(prompt_b, 6, audio_embeds=rows_b)).result()
    prefilled = eng.timings["prefill_tokens"]
    with pytest.raises(ValueError, match="multiple"):
        eng.submit(RequestSpec(prompt_b, 6, audio_embeds=rows_b, continuation=Continuation(kv_prefix=(lease, 100))))
    with pytest.raises(ValueError, match="start with"):
        eng.submit(RequestSpec(prompt_b[1:], 6, audio_embeds=rows_b, continuation=Continuation(kv_prefix=(lease, 256))))
    cont = eng.submit(RequestSpec(prompt_b, 6, audio_embeds=rows_b,
                                  continuation=Continuation(kv_prefix=(lease, 256)))).result()
    assert cont.token_ids == fresh.token_ids
    assert eng.timings["prefill_tokens"] - prefilled == len(prompt_b) - 256
    with pytest.raises(ValueError, match="already used"):
        eng.submit(RequestSpec(prompt_b, 6, audio_embeds=rows_b, continuation=Continuation(kv_prefix=(lease, 256))))
    _idle_kv(eng, before)  # the continuing request freed the blocks it took over


def test_released_and_cancelled_leases_free_their_blocks(tiny_asr) -> None:  # noqa: ANN001
    eng, ck = tiny_asr._core.engine, tiny_asr._core.checkpoint
    before = eng.stats().kv_tokens_used
    rows = _rows(tiny_asr, noise(3.0, seed=12))
    prompt = build_prompt(ck.tokenizer, ck.special, rows.shape[0])
    lease = eng.submit(RequestSpec(prompt, 2, audio_embeds=rows, continuation=Continuation(keep_kv=True))).result().kv
    assert lease is not None and len(lease.blocks) == -(-len(prompt) // eng.stats().kv_block_tokens)
    _idle_kv(eng, before + len(lease.blocks) * eng.stats().kv_block_tokens)  # the prompt's blocks, no more
    eng.release(lease)
    eng.release(lease)  # twice: no-op
    _idle_kv(eng, before)


def test_sessions_leave_no_kv_behind(tiny_asr) -> None:  # noqa: ANN001
    eng = tiny_asr._core.engine
    before = eng.stats().kv_tokens_used
    s = tiny_asr.stream(StreamConfig(chunk_size_sec=1.0, max_new_tokens=2))
    s.push(noise(3.0, seed=3))
    s.finish()
    _idle_kv(eng, before)
    s = tiny_asr.stream(StreamConfig(chunk_size_sec=1.0, max_new_tokens=2))
    s.push(noise(2.0, seed=3))
    s.close()  # abandoned mid-stream
    _idle_kv(eng, before)
