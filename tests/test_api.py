"""The ASR facade: inputs of every kind, per-item errors, long-audio splitting, loading errors."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import soundfile as sf
from conftest import noise

from qasr import ASR, Transcription
from qasr.model.checkpoint import load_checkpoint
from qasr.model.weights import resolve_model_dir
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
    d = tiny_asr.transcribe(data, sample_rate=sr, max_new_tokens=8)[0]
    assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
    assert a.raw == tiny_asr.checkpoint.tokenizer.decode(list(a.token_ids))


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


def test_long_audio_is_split_into_segments(tiny_original) -> None:
    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype="float32", max_chunk_sec=10.0)
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
    assert str(asr.checkpoint.dtype) == "torch.float16"
    r = asr.transcribe((noise(3.0), 16000), max_new_tokens=5)[0]
    assert r.error is None and 1 <= len(r.token_ids) <= 5


def test_auto_dtype_follows_the_cpu(tiny_original) -> None:
    from qasr.model.device import cpu_has_native_bf16

    asr = ASR.from_pretrained(tiny_original, device="auto", dtype="auto")
    expected = "torch.bfloat16" if cpu_has_native_bf16() else "torch.float32"
    assert asr.checkpoint.device.type == "cpu" and str(asr.checkpoint.dtype) == expected
