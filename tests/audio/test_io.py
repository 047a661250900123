"""Tests for qasr.audio.io: real espeak-ng speech in every supported container, plus the error paths."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from qasr.audio.cutting import iter_segments
from qasr.audio.io import SAMPLE_RATE, AudioError, EncodedAudio, audio_duration, load_audio
from qasr.testing.speech import convert, speak

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed to synthesise test audio",
)

# name -> (file name, ffmpeg codec override); "ogg_opus" checks Opus inside a .ogg container.
FORMATS = {
    "flac": ("speech.flac", None),
    "mp3": ("speech.mp3", None),
    "ogg_vorbis": ("speech.ogg", None),
    "ogg_opus": ("speech_opus.ogg", "libopus"),
    "opus": ("speech.opus", None),
    "m4a": ("speech.m4a", None),
    "webm": ("speech.webm", None),
}


@pytest.fixture(scope="module")
def speech_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Synthesise one utterance once and transcode it to every format under test."""
    root = tmp_path_factory.mktemp("speech")
    wav = speak("The quick brown fox jumps over the lazy dog.", root / "speech.wav")
    files = {"wav": wav}
    for name, (file_name, codec) in FORMATS.items():
        files[name] = convert(wav, root / file_name, codec=codec)
    return files


@pytest.mark.parametrize("fmt", ["wav", *FORMATS])
def test_formats_decode_to_mono_16k(speech_files: dict[str, Path], fmt: str) -> None:
    reference = load_audio(speech_files["wav"])
    x = load_audio(speech_files[fmt])
    assert x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous
    assert abs(audio_duration(x) - audio_duration(reference)) < 0.060
    assert 0.05 < np.max(np.abs(x)) <= 1.0
    # The wav is 22.05 kHz espeak output; make sure it really was resampled to 16 kHz.
    assert abs(audio_duration(reference) - sf.info(str(speech_files["wav"])).duration) < 0.001


def test_pathlike_and_str_agree(speech_files: dict[str, Path]) -> None:
    path = speech_files["flac"]
    np.testing.assert_array_equal(load_audio(path), load_audio(str(path)))


@pytest.mark.parametrize("fmt", ["flac", "m4a"])
def test_bytes_input_matches_path(speech_files: dict[str, Path], fmt: str) -> None:
    path = speech_files[fmt]
    data = path.read_bytes()
    np.testing.assert_array_equal(load_audio(data), load_audio(path))
    np.testing.assert_array_equal(load_audio(bytearray(data)), load_audio(path))


def test_stereo_44k_wav_becomes_mono_16k(tmp_path: Path) -> None:
    t = np.arange(44100) / 44100
    tone = np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([0.5 * tone, 0.1 * tone], axis=1)
    path = tmp_path / "stereo.wav"
    sf.write(path, stereo, 44100, subtype="PCM_16")
    x = load_audio(path)
    assert x.dtype == np.float32 and x.ndim == 1
    assert len(x) == SAMPLE_RATE
    assert np.max(np.abs(x[1000:-1000])) == pytest.approx(0.3, abs=0.005)


def test_int_arrays_are_scaled() -> None:
    int16 = np.array([0, 16384, -32768, 32767], dtype=np.int16)
    np.testing.assert_allclose(load_audio(int16, SAMPLE_RATE), [0, 0.5, -1.0, 32767 / 32768])
    int32 = np.array([0, 2**30, -(2**31)], dtype=np.int32)
    np.testing.assert_allclose(load_audio(int32, SAMPLE_RATE), [0, 0.5, -1.0])
    uint8 = np.array([128, 192, 0], dtype=np.uint8)
    np.testing.assert_allclose(load_audio(uint8, SAMPLE_RATE), [0, 0.5, -1.0])
    out = load_audio(np.array([0.25, -0.5], dtype=np.float64), SAMPLE_RATE)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0.25, -0.5])


def test_tuple_input_resamples() -> None:
    x = 0.5 * np.sin(2 * np.pi * 200 * np.arange(8000) / 8000).astype(np.float32)
    out = load_audio((x, 8000))
    assert out.dtype == np.float32 and len(out) == 16000
    np.testing.assert_array_equal(load_audio((x, 16000)), x)
    with pytest.raises(AudioError, match="conflicts"):
        load_audio((x, 8000), sample_rate=16000)


def test_channel_layouts() -> None:
    rng = np.random.default_rng(0)
    channels_first = rng.uniform(-0.5, 0.5, size=(2, 1000)).astype(np.float32)
    expected = channels_first.mean(axis=0)
    np.testing.assert_allclose(load_audio(channels_first, SAMPLE_RATE), expected, rtol=1e-6)
    np.testing.assert_allclose(load_audio(channels_first.T, SAMPLE_RATE), expected, rtol=1e-6)
    with pytest.raises(AudioError, match="array input"):
        load_audio(np.zeros((16, 1000), dtype=np.float32), SAMPLE_RATE)


def test_array_without_sample_rate() -> None:
    with pytest.raises(AudioError, match="array input.*sample_rate"):
        load_audio(np.zeros(100, dtype=np.float32))


def test_peak_normalisation() -> None:
    loud = np.array([0.0, 2.0, -1.0, 4.0], dtype=np.float32)
    np.testing.assert_allclose(load_audio(loud, SAMPLE_RATE), [0.0, 0.5, -0.25, 1.0])
    quiet = np.array([0.0, 0.2, -0.1], dtype=np.float32)
    np.testing.assert_array_equal(load_audio(quiet, SAMPLE_RATE), quiet)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="nope.wav: file not found"):
        load_audio(tmp_path / "nope.wav")


def test_corrupt_mp3(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.mp3"
    path.write_bytes(np.random.default_rng(0).bytes(20000))
    with pytest.raises(AudioError, match="corrupt.mp3.*cannot be decoded"):
        load_audio(path)


def test_text_file_renamed_wav(tmp_path: Path) -> None:
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n" * 50)
    with pytest.raises(AudioError, match="notes.wav.*cannot be decoded"):
        load_audio(path)


def test_empty_wav(tmp_path: Path) -> None:
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, dtype=np.float32), SAMPLE_RATE)
    with pytest.raises(AudioError, match="empty.wav: contains no audio samples"):
        load_audio(path)


def test_nan_samples(tmp_path: Path) -> None:
    path = tmp_path / "nan.wav"
    sf.write(path, np.array([0.0, np.nan, 0.1] * 100, dtype=np.float32), SAMPLE_RATE, subtype="FLOAT")
    with pytest.raises(AudioError, match="nan.wav: contains NaN or infinite samples"):
        load_audio(path)
    with pytest.raises(AudioError, match="array input: contains NaN or infinite"):
        load_audio(np.array([0.0, np.inf], dtype=np.float32), SAMPLE_RATE)


def test_bad_bytes_and_types() -> None:
    with pytest.raises(AudioError, match="bytes input.*cannot be decoded"):
        load_audio(b"definitely not audio" * 20)
    with pytest.raises(AudioError, match="bytes input"):
        load_audio(b"")
    with pytest.raises(AudioError, match="unsupported audio source"):
        load_audio(12345)  # type: ignore[arg-type]


def test_audio_duration() -> None:
    assert audio_duration(np.zeros(24000, dtype=np.float32)) == 1.5


def encoded(path: Path, name: str | None = None, watch=None) -> EncodedAudio:  # noqa: ANN001
    data = path.read_bytes()
    return EncodedAudio(name or path.name, lambda: io.BytesIO(data), len(data), watch)


def test_an_empty_file_has_one_wording_everywhere(tmp_path: Path) -> None:
    """Path, bytes, upload, whole or streamed: the same words (the CLI and the server print these)."""
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    for source, name in ((path, str(path)), (b"", "bytes input"), (encoded(path, "up.wav"), "up.wav")):
        for decode in (load_audio, iter_segments):
            with pytest.raises(AudioError) as err:
                decode(source)
            assert str(err.value) == f"{name}: the file is empty (0 bytes)"


def test_decoder_messages_name_the_input_not_a_handle(tmp_path: Path) -> None:
    """libsndfile names a file object by its repr and FFmpeg by '<none>': neither reaches a message."""
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"this is not audio at all " * 200)
    for source, name in ((junk.read_bytes(), "bytes input"), (encoded(junk), "junk.mp3"), (junk, str(junk))):
        with pytest.raises(AudioError) as err:
            load_audio(source)
        message = str(err.value)
        assert message.startswith(f"{name}: cannot be decoded as audio (soundfile: "), message
        assert "object at 0x" not in message and "<none>" not in message and "Errno" not in message, message


@pytest.mark.parametrize("fmt", ["flac", "webm"])  # libsndfile reads one, only FFmpeg the other
def test_a_watch_sees_every_decoded_second_and_can_stop_the_decoding(speech_files: dict[str, Path],
                                                                      fmt: str) -> None:
    seen: list[float] = []
    whole = load_audio(encoded(speech_files[fmt], watch=seen.append))
    assert max(seen) == pytest.approx(audio_duration(whole), abs=0.03)
    seen.clear()
    list(iter_segments(encoded(speech_files[fmt], watch=seen.append), mode="fixed", block_s=0.5))
    assert max(seen) == pytest.approx(audio_duration(whole), abs=0.03) and len(seen) > 2

    def stop_past_one_second(seconds: float) -> None:
        seen.append(seconds)
        if seconds > 1.0:
            raise AudioError("up: stopped")

    seen.clear()
    with pytest.raises(AudioError, match="^up: stopped$"):
        list(iter_segments(encoded(speech_files[fmt], "up", stop_past_one_second), mode="fixed", block_s=0.5))
    assert max(seen) <= 1.6  # the block that passed 1 s was the last one decoded
