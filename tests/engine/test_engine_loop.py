"""The engine: batching never changes a request's tokens; memory stays within the budget."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import psutil
import pytest
import torch
from conftest import noise, prompt_for

from qasr.engine.cpu.native import linear_kernel
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.engine.runner import pick


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_concurrent_random_arrivals_match_one_by_one(dtype, request) -> None:
    if dtype == "bfloat16" and linear_kernel() is None:
        pytest.skip("bf16 batch invariance rests on qasr's AVX512-BF16 kernels (oneDNN's fallback lacks it)")
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    rng = random.Random(0)
    waves = [noise(rng.uniform(0.3, 20.0), seed=k) for k in range(30)]
    contexts = ["" if k % 3 else "names: Anna, Bo" for k in range(30)]
    prompts = [prompt_for(ck, w, c) for w, c in zip(waves, contexts, strict=True)]
    alone = []
    solo = Engine(ck, EngineConfig(kv_cache_bytes=64 << 20, max_running=1))
    for p, w in zip(prompts, waves, strict=True):
        alone.append(solo.submit(RequestSpec(p, 24, waveform=w)).result().token_ids)
    solo.close()

    engine = Engine(ck, EngineConfig(kv_cache_bytes=64 << 20, max_running=16, step_tokens=300))
    results: list[list[int] | None] = [None] * 30

    def client(k: int) -> None:
        time.sleep(rng.uniform(0, 0.6))
        results[k] = engine.submit(RequestSpec(prompts[k], 24, waveform=waves[k])).result().token_ids

    threads = [threading.Thread(target=client, args=(k,)) for k in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    assert engine.steps > 0
    assert results == alone
    assert sum(len(r) for r in alone) > 30  # the requests really generated text


def test_asyncio_submissions_batch_together(ck) -> None:
    waves = [noise(s, seed=s) for s in (1, 2, 3, 4)]
    engine = Engine(ck, EngineConfig(kv_cache_bytes=16 << 20))

    async def main() -> list:
        return await asyncio.gather(*(engine.generate_async(RequestSpec(prompt_for(ck, w), 8, waveform=w))
                                      for w in waves))

    out = asyncio.run(main())
    expected = [engine.submit(RequestSpec(prompt_for(ck, w), 8, waveform=w)).result().token_ids for w in waves]
    engine.close()
    assert [r.token_ids for r in out] == expected


def test_ignore_eos_forces_exact_length(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=16 << 20))
    w = noise(2.0)
    r = engine.submit(RequestSpec(prompt_for(ck, w), 37, waveform=w, ignore_eos=True)).result()
    engine.close()
    assert len(r.token_ids) == 37 and r.finish_reason == "length" and 0 < r.ttft_s <= r.latency_s


def test_request_larger_than_cache_is_refused_at_submit(ck) -> None:
    engine = Engine(ck, EngineConfig(kv_cache_bytes=kv_bytes_per_token(ck.config.decoder, ck.dtype) * 300))
    big, small = noise(30.0), noise(1.0)
    with pytest.raises(ValueError, match="KV-cache tokens"):
        engine.submit(RequestSpec(prompt_for(ck, big), 4, waveform=big))
    f_small = engine.submit(RequestSpec(prompt_for(ck, small), 4, waveform=small))
    assert len(f_small.result().token_ids) >= 1
    engine.close()


@pytest.mark.slow
def test_a_queue_holds_its_features_and_memory_follows_the_queued_audio(ck) -> None:
    """400 queued 60 s clips: each waiting request holds its log-mel (made at submit, 4/5 of its float32
    waveform's bytes) and no waveform, so the memory a queue takes is 51.2 kB per queued audio second, and
    the front ends bound their queues in audio seconds (ASR's max_in_flight_s, the server's max queued
    audio). RSS grows by the features and little else."""
    CLIPS = 400  # noqa: N806
    wave = noise(60.0)
    prompt = prompt_for(ck, wave)
    budget = 8 * (len(prompt) + 2) * kv_bytes_per_token(ck.config.decoder, ck.dtype)
    engine = Engine(ck, EngineConfig(kv_cache_bytes=budget, max_running=8, step_tokens=4 * 780))
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = base
    per_clip = engine.log_mel(wave).nbytes  # what Engine.submit makes of it
    assert per_clip <= 0.8 * wave.nbytes + 128 * 4 * 2  # 128 mel bins x 100 frames/s vs 16,000 samples/s
    futures = [engine.submit(RequestSpec(prompt, 1, waveform=wave)) for _ in range(CLIPS)]
    while not all(f.done() for f in futures[::20]) or not futures[-1].done():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.01)
    results = [f.result() for f in futures]
    engine.close()
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert peak - base < 1.2 * CLIPS * per_clip + (100 << 20), f"RSS grew by {(peak - base) / 2**20:.0f} MiB"


def test_portable_decode_path_matches_native(ck) -> None:
    """The padded-gather decode path (used on GPUs) gives the same tokens as the CPU kernel."""
    waves = [noise(s, seed=k) for k, s in enumerate((1.5, 6.0, 11.0))]
    prompts = [prompt_for(ck, w) for w in waves]
    out = {}
    for native in (True, False):
        engine = Engine(ck, EngineConfig(kv_cache_bytes=16 << 20, native_kernels=native))
        engine.core.pool.k.fill_(float("nan"))  # the pool is uninitialised memory: nothing may read unwritten slots
        engine.core.pool.v.fill_(float("nan"))
        futures = [engine.submit(RequestSpec(p, 20, waveform=w)) for p, w in zip(prompts, waves, strict=True)]
        out[native] = [f.result().token_ids for f in futures]
        engine.close()
    assert out[True] == out[False]


@pytest.mark.skipif(linear_kernel() is None, reason="bit identity needs qasr's AVX512-BF16 kernels")
def test_packed_encoder_output_is_bit_identical_to_alone(ck_bf16) -> None:
    """Short windows packed next to full ones (and conv chunks grouped with others' chunks) give the
    same bits as the utterance alone: the property every batched request's identity rests on.
    (float32 on CPU uses torch's GEMMs, which may round a row differently by batch size.)"""
    import torch

    from qasr.audio.features import LogMel

    ck = ck_bf16
    kernels = Engine(ck, EngineConfig(kv_cache_bytes=1 << 24)).prepared.kernels  # the engine's CPU kernels
    fe = LogMel(ck.features, "cpu")
    feats = [fe(noise(s, seed=k)).to(ck.dtype) for k, s in enumerate((17.0, 5.4, 0.4, 8.0, 11.3))]
    enc = ck.model.audio_tower
    with torch.inference_mode():
        packed = enc(feats, conv_batch=3, kernels=kernels)
        for f, p in zip(feats, packed, strict=True):
            assert torch.equal(enc([f], conv_batch=3, kernels=kernels)[0], p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pick_is_the_argmax_of_the_logits_and_its_log_softmax(dtype: torch.dtype) -> None:
    """pick() takes its argmax over the float32 copy it makes for the log-softmax: the same index as the argmax of
    the logits themselves, ties to the first and NaN the largest, and the float32 log-softmax at that index."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 3000, generator=gen) * 4).to(dtype)
    logits[0, 7] = logits[0, 2500] = logits[0].max() + 1  # a tie: the first wins
    logits[1, 40] = logits[1, 41] = float("nan")  # NaN is the largest: the first NaN wins
    logits[2] = float("-inf")
    logits[2, 99] = 0.0
    tokens, logprobs = pick(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [7, 40, 99, tokens[3].item()]
    want = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.equal(logprobs[[0, 2, 3]], want[[0, 2, 3]]) and logprobs[1].isnan()
