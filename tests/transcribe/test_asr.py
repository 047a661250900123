"""The ASR facade: inputs of every kind, per-item errors, long-audio splitting, loading errors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import threading
import time
import typing
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import noise, record_log_mel_and_submits

from qasr import ASR, AudioError, Piece, TranscribeOptions, Transcription
from qasr.engine.engine import EngineConfig, RequestSpec
from qasr.engine.request import GenerationResult
from qasr.model.checkpoint import load_checkpoint
from qasr.model.weights import resolve_model_dir
from qasr.outputs.writers import render
from qasr.results import FINISH_SEVERITY, FinishReason
from qasr.testing import make_tiny_checkpoint
from qasr.testing.speech import convert, speak


@pytest.fixture(scope="module")
def speech_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    wav = speak("the quick brown fox jumps over the lazy dog", d / "fox.wav")
    files = {"wav": wav}
    for ext in ("flac", "mp3", "ogg", "m4a", "webm"):
        files[ext] = convert(wav, d / f"fox.{ext}")
    return files


def test_transcribe_every_container(tiny_asr, speech_files) -> None:
    results = tiny_asr.transcribe(list(speech_files.values()), max_new_tokens=6)
    assert len(results) == len(speech_files)
    for r in results:
        assert isinstance(r, Transcription)
        assert r.error is None, r.error
        assert 1 <= len(r.token_ids) <= 6
        assert r.duration == pytest.approx(results[0].duration, abs=0.07)
        assert len(r.segments) == 1 and r.segments[0].start == 0.0


def test_inputs_as_bytes_array_and_tuple_agree(tiny_asr, speech_files) -> None:
    wav = speech_files["wav"]
    data, sr = sf.read(wav, dtype="float32")
    a = tiny_asr.transcribe(wav, max_new_tokens=8)[0]
    b = tiny_asr.transcribe(wav.read_bytes(), max_new_tokens=8)[0]
    c = tiny_asr.transcribe((data, sr), max_new_tokens=8)[0]
    d = tiny_asr.transcribe(data, TranscribeOptions(sample_rate=sr), max_new_tokens=8)[0]
    assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
    assert a.raw == tiny_asr._core.checkpoint.tokenizer.decode(list(a.token_ids))


def test_bad_inputs_fail_alone(tiny_asr, tmp_path, speech_files) -> None:
    corrupt = tmp_path / "corrupt.mp3"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    text_file = tmp_path / "notes.wav"
    text_file.write_text("this is not audio\n" * 20)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 16000)
    nan = noise(1.0)
    nan[100] = np.nan
    good = speech_files["wav"]
    inputs = [good, tmp_path / "missing.wav", corrupt, good, empty, (nan, 16000), text_file, good]
    results = tiny_asr.transcribe(inputs, max_new_tokens=5)
    alone = tiny_asr.transcribe(good, max_new_tokens=5)[0]
    errors = [r.error for r in results]
    for k in (0, 3, 7):
        assert errors[k] is None and results[k].token_ids == alone.token_ids
    for k, needle in ((1, "missing.wav"), (2, "corrupt.mp3"), (4, "empty.wav"), (5, "NaN"), (6, "notes.wav")):
        assert errors[k] is not None and needle in errors[k], errors[k]
        assert results[k].text == "" and results[k].token_ids == ()


def test_language_and_context_validation(tiny_asr) -> None:
    x = noise(1.0)
    with pytest.raises(ValueError, match="English"):
        tiny_asr.transcribe((x, 16000), language="Klingon")
    with pytest.raises(ValueError, match="2 values for 1 inputs"):
        tiny_asr.transcribe((x, 16000), context=["a", "b"])
    r = tiny_asr.transcribe((x, 16000), language="en", max_new_tokens=4)[0]
    assert r.language == "English"
    r2 = tiny_asr.transcribe((x, 16000), language="English", max_new_tokens=4)[0]
    assert r.token_ids == r2.token_ids


def test_long_audio_is_split_into_segments(split_asr) -> None:
    asr = split_asr
    x = noise(25.0)
    x[int(9.5 * 16000):int(10.5 * 16000)] = 0.0  # a quiet spot near the first cut
    r = asr.transcribe((x, 16000), max_new_tokens=3)[0]
    assert r.error is None
    assert len(r.segments) == 3
    assert r.segments[0].start == 0.0 and 9.5 <= r.segments[0].end <= 10.5
    assert r.segments[1].start == r.segments[0].end
    assert r.segments[-1].end == pytest.approx(25.0, abs=1e-3)
    assert len(r.token_ids) == 9  # three pieces, three tokens each
    assert r.duration == pytest.approx(25.0)


def test_sharded_and_bf16_checkpoints_load(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "sharded", layout="original", seed=0, shards=3)
    assert (path / "model.safetensors.index.json").exists()
    ck = load_checkpoint(path, device="cpu", dtype="bfloat16")
    assert ck.dtype.is_floating_point and str(ck.dtype) == "torch.bfloat16"
    r = ASR(ck).transcribe((noise(2.0), 16000), max_new_tokens=4)[0]
    assert r.error is None and len(r.token_ids) >= 1


def test_tied_checkpoint_ties_lm_head(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tied", layout="hf", seed=1, tied=True)
    ck = load_checkpoint(path, device="cpu", dtype="float32")
    assert ck.model.lm_head.weight.data_ptr() == ck.model.model.embed_tokens.weight.data_ptr()


def test_missing_model_offline_error_names_it_and_the_fix(tmp_path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code = ("from qasr.model.weights import resolve_model_dir\n"
            "try:\n    resolve_model_dir('Qwen/Qwen3-ASR-0.6B')\n"
            "except FileNotFoundError as e:\n    print(e)\n")
    out = subprocess.run([os.sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "Qwen/Qwen3-ASR-0.6B" in out.stdout and "path" in out.stdout


def test_directory_without_config_is_rejected(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(tmp_path)


def test_float16_on_cpu_runs(tiny_original) -> None:
    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="float16")
    assert str(asr._core.checkpoint.dtype) == "torch.float16"
    r = asr.transcribe((noise(3.0), 16000), max_new_tokens=5)[0]
    assert r.error is None and 1 <= len(r.token_ids) <= 5


def test_auto_dtype_follows_the_cpu(tiny_original) -> None:
    from qasr.model.checkpoint import cpu_has_native_bf16

    asr = ASR.from_pretrained(tiny_original, device="auto", dtype="auto")
    expected = "torch.bfloat16" if cpu_has_native_bf16() else "torch.float32"
    assert asr._core.checkpoint.device.type == "cpu" and str(asr._core.checkpoint.dtype) == expected


# ---------------------------------------------------------------- the request API: prepare, async, finish reasons

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "qasr-demo-en"
ALARM = ROOT / "examples" / "alarm.flac"


@pytest.fixture(scope="module")
def demo_asr():
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32")
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def split_asr(tiny_original):
    """Cuts at 10 s, so a 25 s input gives three pieces."""
    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="float32", max_chunk_sec=10.0)
    yield asr
    asr.close()


def _spy_submits(monkeypatch, asr: ASR) -> list:
    """Record the futures the engine hands out (the real engine does the work)."""
    futures = []
    real = asr._core.engine.submit

    def submit(*args, **kwargs):
        futures.append(real(*args, **kwargs))
        return futures[-1]

    monkeypatch.setattr(asr._core.engine, "submit", submit)
    return futures


def test_prepared_pieces_driven_by_hand_match_transcribe(split_asr) -> None:
    x = noise(25.0, seed=3)
    pieces = split_asr._core.prepare((x, 16000), TranscribeOptions(max_new_tokens=3))
    assert [type(p) for p in pieces] == [Piece] * 3
    assert {p.source for p in pieces} == {"array input"} and {p.item for p in pieces} == {0}
    audio_id = split_asr._core.checkpoint.config.audio_token_id
    for p in pieces:
        assert p.samples.dtype == np.float32 and p.samples.ndim == 1
        assert p.max_new_tokens == 3 and p.language is None
        assert p.prompt.count(audio_id) > 0
    assert sum(p.duration for p in pieces) == pytest.approx(25.0)
    futures = [split_asr._core.engine.submit(RequestSpec(p.prompt, p.max_new_tokens, waveform=p.samples))
               for p in pieces]
    by_hand = split_asr._core.assemble(pieces, [f.result() for f in futures])
    r = split_asr.transcribe((x, 16000), max_new_tokens=3)[0]
    assert by_hand == r
    assert [s.start for s in r.segments] == [round(p.offset, 3) for p in pieces]


def test_prepare_by_hand_on_the_demo_model(demo_asr) -> None:
    [piece] = demo_asr._core.prepare(ALARM, TranscribeOptions(language="en"))
    assert piece.source == str(ALARM) and piece.language == "English"
    spec = RequestSpec(piece.prompt, piece.max_new_tokens, waveform=piece.samples)
    result = demo_asr._core.engine.submit(spec).result()
    r = demo_asr.transcribe(ALARM, language="en")[0]
    assert tuple(result.token_ids) == r.token_ids and r.text == "set an alarm for seven thirty tomorrow"


def test_prepare_raises_naming_the_bad_input(tiny_asr, tmp_path) -> None:
    good = (noise(1.0), 16000)
    pieces = tiny_asr._core.prepare([good, good], TranscribeOptions(language=["en", None]))
    assert [(p.item, p.language) for p in pieces] == [(0, "English"), (1, None)]
    with pytest.raises(ValueError, match="several inputs"):
        tiny_asr._core.assemble(pieces, [GenerationResult([1], "stop", 0.0, 0.0)] * 2)
    with pytest.raises(AudioError, match="missing.wav"):
        tiny_asr._core.prepare([good, tmp_path / "missing.wav"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_asr._core.prepare(good, TranscribeOptions(max_new_tokens=0))


def test_default_cap_follows_the_audio_not_generation_config(demo_asr) -> None:
    assert demo_asr._core.checkpoint.generation.max_new_tokens == 128  # the limit that used to clip silently
    [long] = demo_asr._core.prepare((np.zeros(30 * 16000, np.float32), 16000),
                                    TranscribeOptions(max_segment_s=30))  # sent whole
    assert long.max_new_tokens == 474  # ceil(15 x 30) + 24
    [short] = demo_asr._core.prepare((np.zeros(38400, np.float32), 16000))
    assert short.max_new_tokens == 60  # 2.4 s: ceil(36) + 24, no floating-point 37
    [forced] = demo_asr._core.prepare((np.zeros(30 * 16000, np.float32), 16000),
                                      TranscribeOptions(max_new_tokens=7, max_segment_s=30))
    assert forced.max_new_tokens == 7


def test_finish_reason_and_the_cut_warning(demo_asr, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="qasr"):
        full = demo_asr.transcribe(ALARM)[0]
    assert full.finish_reason == "stop" and [s.finish_reason for s in full.segments] == ["stop"]
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="qasr"):
        cut = demo_asr.transcribe([ALARM, (noise(1.0), 16000)], max_new_tokens=2)
    assert [r.finish_reason for r in cut] == ["length", "length"]
    assert len(cut[0].token_ids) == 2 and cut[0].segments[0].finish_reason == "length"
    messages = [rec.getMessage() for rec in caplog.records if rec.name.startswith("qasr")]
    assert len(messages) == 2 and "alarm.flac" in messages[0] and "max_new_tokens=2" in messages[0]
    data = json.loads(render(cut[0], "json"))
    assert data["finish_reason"] == "length" and data["segments"][0]["finish_reason"] == "length"


def test_one_finish_reason_vocabulary() -> None:
    """The engine's GenerationResult, segments and transcriptions share the words ranked by severity."""
    assert typing.get_args(FinishReason) == tuple(FINISH_SEVERITY) == ("stop", "length", "malformed")
    assert typing.get_type_hints(GenerationResult)["finish_reason"] == FinishReason


def test_worst_finish_reason_of_a_split_input(split_asr) -> None:
    pieces = split_asr._core.prepare((noise(25.0, seed=3), 16000), TranscribeOptions(language="en"))
    ends = [GenerationResult([5, 6], "stop", 0.0, 0.0), GenerationResult([7], "length", 0.0, 0.0),
            GenerationResult([8], "stop", 0.0, 0.0)]
    r = split_asr._core.assemble(pieces, ends)
    assert [s.finish_reason for s in r.segments] == ["stop", "length", "stop"]
    assert r.finish_reason == "length" and r.token_ids == (5, 6, 7, 8)
    failed = split_asr._core.assemble(pieces, [ends[0], ValueError("boom"), ends[2]])
    assert failed.error == "array input: boom" and failed.finish_reason is None
    auto = split_asr._core.prepare((noise(25.0, seed=3), 16000))  # detect the language: the tag must come out
    tok = split_asr._core.checkpoint.tokenizer
    tagged = GenerationResult(tok.encode("language English<asr_text>hello there"), "stop", 0.0, 0.0)
    fragment = GenerationResult(tok.encode("langu"), "stop", 0.0, 0.0)
    r = split_asr._core.assemble(auto, [tagged, fragment, tagged])
    assert [s.finish_reason for s in r.segments] == ["stop", "malformed", "stop"]
    assert [s.text for s in r.segments] == ["hello there", "", "hello there"]
    assert r.text == "hello there hello there" and r.finish_reason == "malformed" and r.language == "English"
    several = split_asr.transcribe([(noise(1.0), 16000), (np.zeros(0, np.float32), 16000)])
    assert several[1].error == "array input #2: contains no audio samples" and several[1].source == "array input #2"


def test_transcribe_async_matches_transcribe(tiny_asr, speech_files, tmp_path) -> None:
    inputs = [speech_files["wav"], tmp_path / "missing.wav", (noise(2.0), 16000), speech_files["mp3"]]
    sync = tiny_asr.transcribe(inputs, language=["en", None, None, "de"], max_new_tokens=5)
    ticks = []
    got = asyncio.run(tiny_asr.transcribe_async(inputs, language=["en", None, None, "de"], max_new_tokens=5,
                                                progress=ticks.append))
    assert got == sync
    assert got[1].error is not None and "missing.wav" in got[1].error
    # one tick per piece of the three good inputs, with its audio seconds
    assert sorted(ticks) == pytest.approx(sorted(r.duration for r in sync if r.ok), abs=1e-3)


def test_cancelling_transcribe_async_cancels_its_requests(tiny_asr, monkeypatch) -> None:
    futures = _spy_submits(monkeypatch, tiny_asr)
    inputs = [(noise(2.0), 16000), (noise(3.0, seed=1), 16000)]

    async def start_then_cancel() -> None:
        task = asyncio.create_task(tiny_asr.transcribe_async(inputs, TranscribeOptions(ignore_eos=True),
                                                             max_new_tokens=2000))
        while len(futures) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(start_then_cancel())
    assert len(futures) == 2 and all(f.cancelled() for f in futures)
    monkeypatch.undo()
    r = tiny_asr.transcribe(inputs[0], max_new_tokens=4)[0]
    assert r.error is None and len(r.token_ids) >= 1


def test_transcribe_async_bounds_the_audio_in_flight_in_seconds(tiny_asr, monkeypatch) -> None:
    """transcribe_async holds at most max_in_flight_s of audio submitted and unfinished, as transcribe does:
    across inputs, and across the pieces of one long input (it used to bound inputs by count only)."""
    in_flight, peak = [0.0], [0.0]
    lock = threading.Lock()
    real_submit = tiny_asr._core.engine.submit

    def submit(spec, *args, **kwargs):
        seconds = spec.features.shape[-1] / 100  # the pieces bring their log-mel (10 ms frames)
        with lock:
            in_flight[0] += seconds
            peak[0] = max(peak[0], in_flight[0])
        fut = real_submit(spec, *args, **kwargs)

        def done(_) -> None:
            with lock:
                in_flight[0] -= seconds
        fut.add_done_callback(done)  # before the pipeline's own release: this count never lags the budget
        return fut

    monkeypatch.setattr(tiny_asr._core.engine, "submit", submit)
    monkeypatch.setattr(tiny_asr._core, "max_in_flight_s", 1.5)  # one 1 s piece at a time
    inputs = [(noise(1.0, seed=k), 16000) for k in range(4)] + [(noise(4.0, seed=9), 16000)]
    fixed = TranscribeOptions(segmentation="fixed", max_segment_s=1.0)
    got = asyncio.run(tiny_asr.transcribe_async(inputs, fixed, max_new_tokens=3))
    assert all(r.ok for r in got) and [len(r.segments) for r in got] == [1, 1, 1, 1, 4]
    assert 0 < peak[0] <= 1.5, f"{peak[0]} s of audio in flight"
    monkeypatch.undo()
    assert got == tiny_asr.transcribe(inputs, fixed, max_new_tokens=3)


def test_results_come_per_input_while_later_inputs_are_decoded(tiny_asr, monkeypatch) -> None:
    """transcribe_iter hands back an input as soon as it is done; the audio in flight stays bounded."""
    submitted = []
    real_submit = tiny_asr._core.engine.submit

    def submit(*args, **kwargs):
        fut = real_submit(*args, **kwargs)
        submitted.append(fut)
        return fut

    monkeypatch.setattr(tiny_asr._core.engine, "submit", submit)
    monkeypatch.setattr(tiny_asr._core, "max_in_flight_s", 1.5)  # one 1 s input at a time
    inputs = [(noise(1.0, seed=k), 16000) for k in range(4)]
    seen = []
    for i, result in tiny_asr.transcribe_iter(inputs, max_new_tokens=3):
        assert result.ok and result.source == f"array input #{i + 1}"
        # the budget held the next input back until this one's piece finished
        assert len(submitted) <= len(seen) + 2
        seen.append(i)
    assert sorted(seen) == [0, 1, 2, 3] and len(submitted) == 4
    monkeypatch.undo()
    assert [r.token_ids for r in tiny_asr.transcribe(inputs, max_new_tokens=3)] == \
        [tiny_asr.transcribe(x, max_new_tokens=3)[0].token_ids for x in inputs]


def test_closing_transcribe_iter_cancels_the_rest(tiny_asr, monkeypatch, tmp_path) -> None:
    futures = _spy_submits(monkeypatch, tiny_asr)
    inputs = [tmp_path / "missing.wav", (noise(2.0), 16000), (noise(2.0, seed=1), 16000)]
    results = tiny_asr.transcribe_iter(inputs, TranscribeOptions(ignore_eos=True), max_new_tokens=5000)
    i, first = next(results)  # the missing file fails at once; the others are long
    assert i == 0 and "missing.wav" in first.error
    deadline = time.monotonic() + 30
    while len(futures) < 2 and time.monotonic() < deadline:  # the decode thread goes on meanwhile
        time.sleep(0.01)
    assert len(futures) == 2
    results.close()  # the caller stops reading: every request it started stops too
    for fut in futures:
        with pytest.raises(CancelledError):
            fut.result(timeout=10)


def test_a_request_too_big_for_the_kv_cache_fails_alone(tiny_original) -> None:
    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="float32",
                              engine=EngineConfig(kv_cache_bytes=1))  # the smallest cache the engine makes
    try:
        # whole (segmentation "none"): VAD would find no speech in noise and send nothing
        results = asr.transcribe([(noise(1.0), 16000), (noise(60.0), 16000), (noise(1.0), 16000)],
                                 TranscribeOptions(segmentation="none"), max_new_tokens=4)
    finally:
        asr.close()
    assert results[0].ok and results[2].ok and results[0].token_ids == results[2].token_ids
    assert not results[1].ok and results[1].error.startswith("array input") and "KV" in results[1].error


def test_pieces_bring_their_log_mel_made_on_the_feeding_thread(tiny_asr, monkeypatch) -> None:
    """transcribe's pieces reach the engine as features, made by the thread that cuts the input (never the
    engine's), bit-identical to the engine's own log-mel of the samples, with the same tokens."""
    import torch

    from qasr.audio.features import LogMel

    core = tiny_asr._core
    made_on, specs = record_log_mel_and_submits(core, monkeypatch)
    x = noise(4.0, seed=11)
    fixed = TranscribeOptions(segmentation="fixed", max_segment_s=2.0)
    [r] = tiny_asr.transcribe((x, 16000), fixed, max_new_tokens=3)
    assert r.ok and len(specs) == 2 and made_on == ["qasr-decode"] * 2
    assert all(s.waveform is None and s.features is not None for s in specs)
    monkeypatch.undo()
    pieces = core.prepare((x, 16000), fixed)
    reference = LogMel(core.checkpoint.features)
    for spec, piece in zip(specs, pieces, strict=True):
        assert torch.equal(spec.features, reference(piece.samples))
    by_waveform = [core.engine.submit(RequestSpec(p.prompt, 3, waveform=p.samples)).result() for p in pieces]
    assert tuple(t for g in by_waveform for t in g.token_ids) == r.token_ids
