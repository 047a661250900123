"""A kept KV prefix continued from any position, where the kernels allow it: with row-invariant linears and
norms and a prefill attention that computes each query row alone, a prompt row's bits do not depend on how
the prompt is cut into chunks, so a live step reuses its head and closed windows exactly instead of rounding
the reuse down to the 256-token prefill grid. Elsewhere (float32, torch's GEMMs) the grid stays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qasr.audio.features import LogMel
from qasr.engine.engine import Continuation, RequestSpec
from qasr.model.prompt import build_prompt
from qasr.streaming.config import StreamConfig
from qasr.streaming.oracle import OracleStream
from qasr.streaming.session import Session
from qasr.testing import make_tiny_checkpoint
from tests.conftest import noise


@pytest.fixture(scope="module")
def asr128(tmp_path_factory):  # noqa: ANN001, ANN201
    """bf16 with head_dim 128, the released models' head size: the engine runs qasr's production kernels."""
    from qasr import ASR

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("d128"), seed=3, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    asr = ASR.from_pretrained(path, device="cpu", dtype="bfloat16")
    if not asr._core.engine.prepared.chunk_invariant_prefill:
        asr.close()
        pytest.skip("no native bf16 kernels here (AVX512-BF16 and a compiler): the prefix stays on the grid")
    yield asr
    asr.close()


def rows_of(asr, wave: np.ndarray) -> torch.Tensor:  # noqa: ANN001
    eng = asr._core.engine
    with torch.inference_mode():
        return eng.prepared.model.audio_tower([LogMel(asr._core.checkpoint.features)(wave)],
                                              conv_batch=eng.core.runner.conv_batch,
                                              kernels=eng.core.runner.kernels)[0]


def test_where_a_prefix_may_be_cut(asr128, tiny_asr) -> None:  # noqa: ANN001
    assert asr128._core.engine.prefix_grid == 1
    eng = tiny_asr._core.engine  # float32: torch's GEMMs pick their blocking by the rows, so the grid stays
    assert not eng.prepared.chunk_invariant_prefill and eng.prefix_grid == eng.config.prefill_chunk


@pytest.mark.parametrize("cut", [1, 37, 100])
def test_a_prefix_continued_off_the_grid_gives_the_bits_of_a_fresh_prefill(asr128, cut: int) -> None:  # noqa: ANN001
    eng, ck = asr128._core.engine, asr128._core.checkpoint
    wave = noise(14.0, seed=cut)
    rows_a, rows_b = rows_of(asr128, wave[:16000 * 9]), rows_of(asr128, wave)  # window 0 closed in both
    assert torch.equal(rows_a[:104], rows_b[:104])
    prompt_a = build_prompt(ck.tokenizer, ck.special, rows_a.shape[0])
    prompt_b = build_prompt(ck.tokenizer, ck.special, rows_b.shape[0])
    head = prompt_a.index(ck.special.audio_pad)
    assert cut <= head + 104 and rows_a.shape[0] < rows_b.shape[0]  # inside the head and the shared window
    lease = eng.submit(RequestSpec(prompt_a, 3, audio_embeds=rows_a,
                                   continuation=Continuation(keep_kv=True))).result(timeout=60).kv
    fresh = eng.submit(RequestSpec(prompt_b, 8, audio_embeds=rows_b, ignore_eos=True)).result(timeout=60)
    prefilled = eng.timings["prefill_tokens"]
    cont = eng.submit(RequestSpec(prompt_b, 8, audio_embeds=rows_b, ignore_eos=True,
                                  continuation=Continuation(kv_prefix=(lease, cut)))).result(timeout=60)
    assert eng.timings["prefill_tokens"] - prefilled == len(prompt_b) - cut  # the prefix was not prefilled again
    assert cont.token_ids == fresh.token_ids and cont.logprobs == fresh.logprobs  # float32 values, bit for bit


def test_a_session_past_its_first_window_reuses_it_and_matches_the_oracle(asr128) -> None:  # noqa: ANN001
    """20 s in 2 s steps: from 10 s on the first 8 s window is closed and kept, and each step prefills only
    what follows it (the head and the window are reused off the grid); every step equals the official
    algorithm's full recomputation, prompt and tokens."""
    cfg = StreamConfig(chunk_size_sec=2.0, unfixed_chunk_num=2, unfixed_token_num=3, max_new_tokens=5)
    session = Session(asr128._core.engine, asr128._core.checkpoint, cfg, record=True)
    oracle = OracleStream(asr128._core.engine, asr128._core.checkpoint, cfg)
    audio = noise(20.0, seed=21)
    for i in range(0, audio.size, 32000):
        session.push(audio[i:i + 32000])
        oracle.push(audio[i:i + 32000])
    session.finish()
    oracle.finish()
    assert len(session.results) == len(oracle.results) == 10
    for mine, ref in zip(session.results, oracle.results, strict=True):
        assert mine.prompt == ref.prompt and mine.generated == ref.generated, mine.index
    head = session.results[0].prompt.index(asr128._core.checkpoint.special.audio_pad)
    # reused: the head, plus the windows closed at the step before (window 0 from the step at 10 s on, window 1
    # from the one at 18 s); with the 256-token grid none of these would be (each prompt is under 300 tokens)
    closed_before = {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1, 9: 2}
    for step, windows in closed_before.items():
        want = len(session.results[step].prompt) - head - 104 * windows
        assert session.stats.prefill_tokens[step] == want, (step, session.stats.prefill_tokens)
