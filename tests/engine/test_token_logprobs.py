"""Confidence: each generated token's log-probability (engine), a segment's avg_logprob and compression_ratio
(results), and the outputs that carry them (json, verbose_json)."""

from __future__ import annotations

import json
import math
import threading
import zlib

import numpy as np
import pytest
import torch
from conftest import noise, prompt_for, reference_logprobs

from qasr import TranscribeOptions
from qasr.engine.cpu.native import linear_kernel
from qasr.engine.cuda import graphs as cuda_graphs
from qasr.engine.cuda import prepare as cuda_prepare
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.engine.request import GenerationResult
from qasr.outputs.writers import render
from qasr.results import Segment, Transcription
from qasr.server.responses import verbose_json
from qasr.server.work import Finished
from qasr.transcribe.assemble import avg_logprob, compression_ratio

KV = 64 << 20
WAIT_S = 120





def generate(ck, waves: list[np.ndarray], new_tokens: int = 16, **config) -> list[GenerationResult]:  # noqa: ANN003
    """Every wave submitted at once (they share steps), each forced to ``new_tokens`` tokens."""
    with Engine(ck, EngineConfig(**{"kv_cache_bytes": KV, **config})) as engine:
        futures = [engine.submit(RequestSpec(prompt_for(ck, w), new_tokens, waveform=w, ignore_eos=True))
                   for w in waves]
        return [f.result(WAIT_S) for f in futures]


# ------------------------------------------------------------------------------------------- the engine
def test_logprobs_match_a_float32_teacher_forced_reference(ck) -> None:
    waves = [noise(s, seed=k) for k, s in enumerate((0.7, 3.1, 9.3))]
    for wave, result in zip(waves, generate(ck, waves), strict=True):
        assert len(result.logprobs) == len(result.token_ids) == 16
        want = reference_logprobs(ck, wave, prompt_for(ck, wave), result.token_ids)
        assert all(lp <= 0 for lp in result.logprobs)
        np.testing.assert_allclose(result.logprobs, want, rtol=1e-4, atol=1e-4)
        # the chosen token is the argmax, so its log-probability is the row's largest
        assert min(result.logprobs) > -math.log(ck.config.decoder.vocab_size) - 1e-3


def test_eos_is_left_out_like_the_ids(ck) -> None:
    wave = noise(2.0, seed=3)
    forced = generate(ck, [wave], new_tokens=24)[0]  # ignore_eos: EOS ids stay in the output
    eos = frozenset(ck.generation.eos_token_ids) | {forced.token_ids[5]}  # the sixth token made an EOS too
    with Engine(ck, EngineConfig(kv_cache_bytes=KV)) as engine:
        engine.core.eos = eos
        result = engine.submit(RequestSpec(prompt_for(ck, wave), 24, waveform=wave)).result(WAIT_S)
    cut = next(i for i, t in enumerate(forced.token_ids) if t in eos)
    assert result.finish_reason == "stop" and result.token_ids == forced.token_ids[:cut]
    assert result.logprobs == forced.logprobs[:cut]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_logprobs_do_not_depend_on_its_batch(dtype, request) -> None:
    """The same requests alone and sharing their steps: the same tokens; in bf16 (row-invariant kernels)
    the very same logprobs, in float32 (torch's GEMMs may round a row by batch size) within rounding."""
    if dtype == "bfloat16" and linear_kernel() is None:
        pytest.skip("bf16 row invariance rests on qasr's AVX512-BF16 kernels (oneDNN's fallback lacks it)")
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    waves = [noise(s, seed=10 + k) for k, s in enumerate((0.5, 2.2, 4.0, 7.7, 12.5, 1.3))]
    alone = [generate(ck, [w], max_running=1)[0] for w in waves]
    together = generate(ck, waves, max_running=8)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    if dtype == "bfloat16":
        assert [r.logprobs for r in together] == [r.logprobs for r in alone]
    else:
        for a, t in zip(alone, together, strict=True):
            np.testing.assert_allclose(t.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_preempted_request_recomputes_the_same_logprobs(dtype, request) -> None:
    """A pool of 32 16-token blocks: A decodes 300 tokens; C arrives once A made its first token, both
    decode past 16 blocks each and C, the youngest, is preempted and recomputed. Its logprobs are those
    of a run alone (bit for bit in bf16)."""
    if dtype == "bfloat16" and linear_kernel() is None:
        pytest.skip("bf16 row invariance rests on qasr's AVX512-BF16 kernels")
    ck = request.getfixturevalue("ck" if dtype == "float32" else "ck_bf16")
    a_wave, c_wave = noise(2.0, seed=4), noise(2.0, seed=6)
    config = dict(kv_block_tokens=16, prefill_chunk=16, step_tokens=16)
    want = [generate(ck, [w], new_tokens=300, **config)[0] for w in (a_wave, c_wave)]
    pool = 512 * kv_bytes_per_token(ck.config.decoder, ck.dtype)
    with Engine(ck, EngineConfig(kv_cache_bytes=pool, **config)) as engine:
        second = []
        started = threading.Event()

        def arrive(token: int | None) -> None:
            if token is not None and not started.is_set():
                started.set()
                second.append(engine.submit(RequestSpec(prompt_for(ck, c_wave), 300, waveform=c_wave, ignore_eos=True)))

        first = engine.submit(RequestSpec(prompt_for(ck, a_wave), 300, waveform=a_wave, ignore_eos=True),
                              on_token=arrive)
        got = [first.result(WAIT_S), second[0].result(WAIT_S)]
    assert got[1].preempted == ("decode",) and got[0].preempted == ()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and len(g.logprobs) == 300
        if dtype == "bfloat16":
            assert g.logprobs == w.logprobs
        else:
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)


class FakeGraph:
    """A captured CUDA graph stood in for on CPU tensors: a replay runs its step's forward on the rows
    loaded into the static buffers (what a graph does)."""

    def __init__(self, forward, mempool) -> None:  # noqa: ANN001 - capture_graph's arguments
        self.step = forward.__self__

    def replay(self) -> None:
        self.step.forward(self.step.meta(self.step._rows))


@pytest.mark.parametrize("graphs", ["off", "eager", "capture"])
def test_the_cuda_backend_gives_the_cpu_backends_logprobs(ck, graphs, monkeypatch) -> None:
    """The CUDA runner on CPU tensors: eager steps, bucketed static-buffer steps and (faked) graph replays,
    the first replay checked against the eager forward, all read tokens and logprobs back together."""
    waves = [noise(s, seed=k) for k, s in enumerate((0.7, 3.1))]
    want = [generate(ck, [w])[0] for w in waves]
    if graphs == "capture":
        monkeypatch.setattr(cuda_prepare, "graphs_mode", lambda *a: "capture")
        monkeypatch.setattr(cuda_graphs, "capture_graph", FakeGraph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    config = dict(backend="cuda", cuda_graphs=graphs != "off")
    got = [generate(ck, [w], **config)[0] for w in waves]  # alone: consecutive blocks, so decode is bucketed
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- segments
def test_compression_ratio_of_known_strings() -> None:
    assert compression_ratio("") is None
    text = "the quick brown fox jumps over the lazy dog"
    assert compression_ratio(text) == len(text) / len(zlib.compress(text.encode()))
    assert compression_ratio(text) < 1.0  # short text: zlib's header outweighs what it saves
    loop = "thank you " * 30  # a repetition loop compresses well: far above Whisper's 2.4
    assert compression_ratio(loop) == 300 / len(zlib.compress(loop.encode())) and compression_ratio(loop) > 10
    assert compression_ratio("你好") == 6 / len(zlib.compress("你好".encode()))  # UTF-8 bytes, not characters


def test_avg_logprob_is_the_mean_over_the_generated_tokens() -> None:
    assert avg_logprob(GenerationResult([5, 6, 7], "stop", 0.0, 0.0, logprobs=(-0.5, -1.0, -3.0))) == -1.5
    assert avg_logprob(GenerationResult([], "stop", 0.0, 0.0)) is None  # nothing generated
    assert avg_logprob(GenerationResult([5], "stop", 0.0, 0.0)) is None  # a result made without logprobs


def test_a_transcribed_segment_carries_the_reference_avg_logprob(tiny_asr) -> None:
    """Through the whole path: transcribe (engine, read_piece) against the float32 reference over the
    piece's prompt and the generated tokens (preamble and text alike)."""
    wave = noise(2.5, seed=21)
    (piece,) = tiny_asr._core.prepare(wave, TranscribeOptions(sample_rate=16000))
    t = tiny_asr.transcribe(wave, TranscribeOptions(sample_rate=16000, ignore_eos=True), max_new_tokens=20)[0]
    (seg,) = t.segments
    assert len(t.token_ids) == 20
    want = reference_logprobs(tiny_asr._core.checkpoint, piece.samples, list(piece.prompt), list(t.token_ids))
    assert seg.avg_logprob == pytest.approx(sum(want) / len(want), abs=1e-4)
    assert seg.compression_ratio == compression_ratio(seg.text)


# ------------------------------------------------------------------------------------------- outputs
SEGMENTS = (Segment(0.0, 2.5, "call anna", avg_logprob=-0.123456, compression_ratio=0.6923077),
            Segment(2.5, 4.0, "", avg_logprob=-2.0),
            Segment(4.0, 5.0, ""))


def test_json_carries_avg_logprob_and_compression_ratio() -> None:
    t = Transcription("call anna", "English", 5.0, segments=SEGMENTS, finish_reason="stop")
    segs = json.loads(render(t, "json"))["segments"]
    assert [(s["avg_logprob"], s["compression_ratio"]) for s in segs] == [(-0.1235, 0.6923), (-2.0, None),
                                                                          (None, None)]


def test_verbose_json_carries_avg_logprob_and_compression_ratio() -> None:
    t = Transcription("call anna", "English", 5.0, segments=SEGMENTS, finish_reason="stop")
    body = verbose_json(Finished(t, ((1, 2), (), ()), 10, 5, 7, 0.1))
    assert [(s["avg_logprob"], s["compression_ratio"], s["no_speech_prob"]) for s in body["segments"]] == [
        (-0.1235, 0.6923, None), (-2.0, None, None), (None, None, None)]
