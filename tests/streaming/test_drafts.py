"""Guessed tokens checked as the engine decodes (``Continuation.draft``): each guess is fed in a decode row
of its own beside the request's newest token, and the tokens of the rows whose guesses before them came true
are kept. Where a decode row's bits do not depend on the rows beside it (qasr's bf16 and quantized CPU
kernels), the output, its log-probabilities and the listener's calls are those without a draft, bit for bit,
whatever the draft holds; elsewhere the draft is ignored. A live step guesses the tokens its prefix rolled
back, which it mostly makes again."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import noise, prompt_for

from qasr.engine.engine import Continuation, Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import kv_bytes_per_token
from qasr.engine.scheduler import DRAFT_ROWS
from qasr.streaming.config import StreamConfig
from qasr.streaming.oracle import OracleStream
from qasr.streaming.session import Session
from qasr.streaming.text import encode_raw, rollback
from qasr.testing import make_tiny_checkpoint

WAIT_S = 120
KV = 2**24
TOKENS = 30


@pytest.fixture(scope="module")
def path128(tmp_path_factory):  # noqa: ANN001, ANN201
    """head_dim 128, the released models' head size: every native kernel the production path uses runs."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("drafts"), seed=3, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128)


@pytest.fixture(scope="module", params=[None, "int8", "int4"])
def engine(request, path128):  # noqa: ANN001, ANN201
    from qasr.model.checkpoint import load_checkpoint

    ck = load_checkpoint(path128, device="cpu", dtype="bfloat16")
    eng = Engine(ck, EngineConfig(kv_cache_bytes=KV, quantize=request.param))
    if not eng.verifies_drafts:
        eng.close()
        pytest.skip("no row-invariant native decode here (AVX512-BF16 or AVX512-VNNI and a compiler): drafts are "
                    "ignored, as test_a_draft_is_ignored_where_rows_are_not_invariant checks")
    yield eng
    eng.close()


def run(eng: Engine, wave: np.ndarray, draft: list[int] = (), new_tokens: int = TOKENS, **kw) -> tuple:  # noqa: ANN003
    """(result, the listener's calls, decode rows of guesses, guesses kept, engine steps) of one request alone."""
    heard: list[int | None] = []
    t0, steps0 = dict(eng.timings), eng.steps
    spec = RequestSpec(prompt_for(eng.checkpoint, wave), new_tokens, waveform=wave,
                       continuation=Continuation(draft=draft), **{"ignore_eos": True, **kw})
    result = eng.submit(spec, on_token=heard.append).result(WAIT_S)
    return (result, heard, eng.timings["draft_rows"] - t0["draft_rows"], eng.timings["draft_kept"] - t0["draft_kept"],
            eng.steps - steps0)


def test_every_draft_gives_the_output_of_none(engine) -> None:  # noqa: ANN001
    wave = noise(3.0, seed=1)
    plain, heard, rows, kept, plain_steps = run(engine, wave)
    assert rows == kept == 0 and heard == [*plain.token_ids, None]
    t = plain.token_ids
    wrong = (t[5] + 1) % engine.checkpoint.config.decoder.vocab_size
    drafts = {"right": t[:12], "wrong at 5": [*t[:5], wrong, *t[6:12]], "longer than the output": t + t,
              "wrong from the start": [wrong, *t[1:10]], "wrong after the prefill's token": [t[0], wrong, *t[2:9]]}
    for name, draft in drafts.items():
        got, heard, rows, kept, steps = run(engine, wave, draft)
        assert got.token_ids == t and got.logprobs == plain.logprobs, name  # float32 values, bit for bit
        assert heard == [*t, None] and got.finish_reason == plain.finish_reason, name
        if name == "right":  # the prefill makes t[0]; the next step checks t[1..8], the one after t[10..11]
            assert (rows, kept) == (DRAFT_ROWS + 2, DRAFT_ROWS + 2) and steps == plain_steps - DRAFT_ROWS - 2
        if name == "wrong at 5":  # t[1..4] kept, t[5] made by the row fed t[4]; the rest of the draft is dropped
            assert (rows, kept) == (DRAFT_ROWS, 4)
        if name == "longer than the output":  # 29 tokens after the prefill's, 9 a step: 8 + 8 + 8 + 1 guesses
            assert (rows, kept) == (25, 25) and steps == plain_steps - 25  # never a row past max_new_tokens
        if name == "wrong from the start":
            assert rows == kept == 0
        if name == "wrong after the prefill's token":
            assert kept == 0 and rows == DRAFT_ROWS


def test_a_request_that_ends_among_kept_guesses_stops_there(engine, monkeypatch) -> None:  # noqa: ANN001
    """An end of sequence (here: a token made an EOS id for the test) or max_new_tokens met inside a step's
    kept guesses ends the request at that token: nothing after it is output or heard."""
    wave = noise(3.0, seed=2)
    t = run(engine, wave)[0].token_ids
    stop = t[6]
    first = t.index(stop)
    monkeypatch.setattr(engine.core, "eos", frozenset({stop}))
    plain, heard_plain, *_ = run(engine, wave, ignore_eos=False)
    assert plain.finish_reason == "stop" and plain.token_ids == t[:first]
    got, heard, rows, kept, _ = run(engine, wave, draft=t, ignore_eos=False)
    assert (got.token_ids, got.logprobs, got.finish_reason) == (plain.token_ids, plain.logprobs, "stop")
    assert heard == heard_plain and kept >= first - 1
    monkeypatch.undo()
    for cap in (1, 2, 5, 9):
        got, heard, *_ = run(engine, wave, draft=t, new_tokens=cap)
        assert got.token_ids == t[:cap] and heard == [*t[:cap], None] and got.finish_reason == "length"


def test_requests_with_and_without_drafts_together_give_their_outputs_alone(engine) -> None:  # noqa: ANN001
    waves = [noise(s, seed=10 + k) for k, s in enumerate((1.3, 3.7, 6.1))]
    alone = [run(engine, w)[0] for w in waves]
    drafts = [alone[0].token_ids, [], [*alone[2].token_ids[:4], 0, *alone[2].token_ids[5:]]]
    futures = [engine.submit(RequestSpec(prompt_for(engine.checkpoint, w), TOKENS, waveform=w, ignore_eos=True,
                                         continuation=Continuation(draft=d)))
               for w, d in zip(waves, drafts, strict=True)]
    for f, want in zip(futures, alone, strict=True):
        got = f.result(WAIT_S)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_a_listener_that_fails_among_kept_guesses_ends_its_request_there(engine) -> None:  # noqa: ANN001
    wave = noise(2.0, seed=3)
    t = run(engine, wave)[0].token_ids
    heard: list[int | None] = []

    def listener(token: int | None) -> None:
        heard.append(token)
        if len(heard) == 4:
            raise RuntimeError("the consumer went away")

    future = engine.submit(RequestSpec(prompt_for(engine.checkpoint, wave), TOKENS, waveform=wave, ignore_eos=True,
                                       continuation=Continuation(draft=t)), on_token=listener)
    with pytest.raises(RuntimeError, match="went away"):
        future.result(WAIT_S)
    assert heard == t[:4]  # the kept guesses after the failing call were not handed out
    assert run(engine, wave)[0].token_ids == t  # and the engine goes on


def test_a_preempted_request_with_a_draft_recomputes_the_same_output(path128) -> None:  # noqa: ANN001
    """A pool of 32 16-token blocks: A decodes 300 tokens, C arrives once A made its first; both need more than
    half the pool, so C, the younger, is preempted and recomputed. Both guess their whole output."""
    from qasr.model.checkpoint import load_checkpoint

    ck = load_checkpoint(path128, device="cpu", dtype="bfloat16")
    config = dict(kv_block_tokens=16, prefill_chunk=16, step_tokens=16)
    a_wave, c_wave = noise(2.0, seed=4), noise(2.0, seed=6)
    with Engine(ck, EngineConfig(kv_cache_bytes=KV, **config)) as eng:
        if not eng.verifies_drafts:
            pytest.skip("no row-invariant native decode here: drafts are ignored")
        want = [run(eng, w, new_tokens=300)[0] for w in (a_wave, c_wave)]
    pool = 512 * kv_bytes_per_token(ck.config.decoder, ck.dtype)
    with Engine(ck, EngineConfig(kv_cache_bytes=pool, **config)) as eng:
        second = []
        started = threading.Event()

        def arrive(token: int | None) -> None:
            if token is not None and not started.is_set():
                started.set()
                second.append(eng.submit(RequestSpec(prompt_for(ck, c_wave), 300, waveform=c_wave, ignore_eos=True,
                                                     continuation=Continuation(draft=want[1].token_ids))))

        first = eng.submit(RequestSpec(prompt_for(ck, a_wave), 300, waveform=a_wave, ignore_eos=True,
                                       continuation=Continuation(draft=want[0].token_ids)), on_token=arrive)
        got = [first.result(WAIT_S), second[0].result(WAIT_S)]
        assert eng.timings["draft_kept"] > 0
    assert got[1].preempted and not got[0].preempted
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def assert_drafts_ignored(eng: Engine, seed: int) -> None:
    assert not eng.verifies_drafts
    wave = noise(2.0, seed=seed)
    plain = run(eng, wave, new_tokens=12)[0]
    got, _, rows, kept, _ = run(eng, wave, draft=plain.token_ids, new_tokens=12)
    assert got.token_ids == plain.token_ids and rows == kept == 0


def test_a_draft_is_ignored_where_rows_are_not_invariant(tiny_asr) -> None:  # noqa: ANN001
    """float32 on torch's or oneDNN's GEMMs: a row's bits may depend on the rows beside it, so checking guesses
    could change a token; the engine drops the draft."""
    assert_drafts_ignored(tiny_asr._core.engine, seed=5)


def test_drafts_can_be_turned_off(path128) -> None:  # noqa: ANN001
    from qasr.model.checkpoint import load_checkpoint

    ck = load_checkpoint(path128, device="cpu", dtype="bfloat16")
    with Engine(ck, EngineConfig(kv_cache_bytes=KV, drafts=False)) as eng:
        assert_drafts_ignored(eng, seed=7)


def test_a_malformed_draft_is_refused_at_submit(tiny_asr) -> None:  # noqa: ANN001
    eng = tiny_asr._core.engine
    wave = noise(1.0, seed=1)
    prompt = prompt_for(tiny_asr._core.checkpoint, wave)
    vocab = tiny_asr._core.checkpoint.config.decoder.vocab_size
    for bad in ([vocab], [-1], [1.5], [True], "ab"):
        with pytest.raises(ValueError, match="draft"):  # refused wherever it runs, used or not
            eng.submit(RequestSpec(prompt, 4, waveform=wave, continuation=Continuation(draft=bad)))


def test_a_live_step_guesses_the_tokens_its_prefix_rolled_back(path128) -> None:  # noqa: ANN001
    from qasr import ASR

    asr = ASR.from_pretrained(path128, device="cpu", dtype="bfloat16")
    try:
        ck = asr._core.checkpoint
        cfg = StreamConfig(chunk_size_sec=1.0, unfixed_chunk_num=2, unfixed_token_num=5, max_new_tokens=9)
        session = Session(asr._core.engine, ck, cfg, record=True)
        oracle = OracleStream(asr._core.engine, ck, cfg)
        raw = "language English<asr_text>one two three four five six seven"
        session.state.raw = raw
        ids = encode_raw(ck.tokenizer, ck.special, raw)
        prefix = rollback(ck.tokenizer, ck.special, raw, 5)
        assert session.state.guess(prefix) == ids[len(ids) - 5:] and session.state.guess("") == ids
        session.state.raw = ""
        assert session.state.guess("") == []
        if not asr._core.engine.verifies_drafts:
            pytest.skip("no row-invariant native decode here: drafts are ignored")
        audio = noise(8.0, seed=31)
        t0 = dict(asr._core.engine.timings)
        for i in range(0, audio.size, 16000):
            session.push(audio[i:i + 16000])
        kept = asr._core.engine.timings["draft_kept"] - t0["draft_kept"]
        for i in range(0, audio.size, 16000):
            oracle.push(audio[i:i + 16000])
        session.finish()
        oracle.finish()
        assert kept > 0  # the random model makes its rolled-back tokens again, as a trained one does
        for ours, theirs in zip(session.results, oracle.results, strict=True):
            assert (ours.prompt, ours.generated, ours.text) == (theirs.prompt, theirs.generated, theirs.text)
    finally:
        asr.close()
