"""Folder jobs and the command line's behaviour around them, run as real subprocesses on the demo model.

Covers: output paths that never collide, resumable runs after SIGINT with nothing partial left behind,
failed.tsv, JSON Lines and prefixed text on stdout, early usage errors, pipes closed early, file modes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from server_proc import qasr_command

from qasr.testing.speech import convert, speak

ROOT = Path(__file__).resolve().parents[2]
DEMO = ("-m", str(ROOT / "models" / "qasr-demo-en"), "--device", "cpu", "--dtype", "float32", "--no-progress")
SENTENCES = ("set an alarm for six", "call anna tomorrow", "turn off the lights", "what is the weather",
             "play some music", "remind me at nine")


def qasr(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qasr", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kwargs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """a/clip.wav, a/clip.flac, b/clip.wav (same stems), deeper/x/long.mp3 (pauses), a corrupt file,
    a silent file, a text file that is not media, and enough short clips for a run to be interrupted."""
    root = tmp_path_factory.mktemp("job") / "in"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "deeper" / "x").mkdir(parents=True)
    speak("set an alarm for six forty five", root / "a" / "clip.wav")
    convert(speak("set a timer for ten minutes", root / "tmp.wav"), root / "a" / "clip.flac")
    speak("call anna on the ninth of july", root / "b" / "clip.wav")
    for k in range(18):
        speak(SENTENCES[k % len(SENTENCES)], root / "b" / f"many{k:02d}.wav", speed=140 + 3 * k)
    parts = []
    for k, sentence in enumerate(SENTENCES):
        wave, sr = sf.read(speak(sentence, root / "tmp.wav"), dtype="float32")
        parts += [wave, np.zeros(int(sr * (1.5 + k % 3)), np.float32)]
    # about 5 minutes, decoded last: it keeps the interrupted run busy after its first outputs appear
    sf.write(root / "tmp.wav", np.concatenate(parts * 16), sr)
    convert(root / "tmp.wav", root / "deeper" / "x" / "long.mp3")
    (root / "tmp.wav").unlink()
    (root / "a" / "corrupt.mp3").write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    sf.write(root / "b" / "silence.wav", np.zeros(16000 * 40, np.float32), 16000)
    (root / "notes.txt").write_text("not audio\n")
    return root


def _outputs(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


def _one_input_complete(out: Path) -> bool:
    return any(p.with_suffix(".srt").exists() for p in out.rglob("*.json"))


@pytest.mark.slow
def test_folder_job_interrupted_then_resumed(folder, tmp_path) -> None:
    full = tmp_path / "full"
    done = qasr("transcribe", str(folder), "-r", "-o", str(full), "-f", "json,srt", *DEMO)
    assert done.returncode == 1, done.stderr  # the corrupt file failed; every other input is done
    names = set(_outputs(full))
    for base in ("a/clip.wav", "a/clip.flac", "b/clip", "deeper/x/long", "b/silence", "b/many00"):
        assert f"{base}.json" in names and f"{base}.srt" in names
    assert not any("corrupt" in n or "notes" in n for n in names)
    failed = (full / "failed.tsv").read_text().splitlines()
    assert failed[0] == "input\terror" and len(failed) == 2 and "corrupt.mp3" in failed[1]
    silence = json.loads((full / "b" / "silence.json").read_text())
    assert silence["text"] == "" and silence["error"] is None and silence["duration"] == pytest.approx(40.0)
    long = json.loads((full / "deeper" / "x" / "long.json").read_text())
    starts = [s["start"] for s in long["segments"]]
    assert len(starts) > 1 and starts == sorted(starts) and long["duration"] > 30

    part = tmp_path / "part"
    proc = subprocess.Popen(qasr_command("transcribe", str(folder), "-r", "-o", str(part),
                                         "-f", "json,srt", "--max-running", "1", *DEMO), cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    # Wait until one input has all its formats: outputs land one file at a time, so an input caught between
    # its .json and its .srt is rightly redone, and the resumed run would then have nothing to skip.
    while not _one_input_complete(part) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    first = _outputs(part)
    assert 0 < len([n for n in first if n.endswith(".json")]) < len([n for n in names if n.endswith(".json")])
    assert not [p for p in part.rglob("*") if p.name.startswith(".")], "temporary files left behind"
    for name, text in first.items():  # whatever exists is complete and equal to the uninterrupted run
        if name != "failed.tsv":
            assert text == _outputs(full)[name], name

    again = qasr("transcribe", str(folder), "-r", "-o", str(part), "-f", "json,srt", *DEMO)
    assert again.returncode == 1, again.stderr
    assert "already have their outputs; skipping them" in again.stderr
    assert _outputs(part) == _outputs(full)
    assert not [p for p in part.rglob("*") if p.name.startswith(".")]


def test_same_stems_never_overwrite_each_other(folder, tmp_path) -> None:
    a, b = folder / "a", folder / "b"
    out = qasr("transcribe", str(a / "clip.wav"), str(b / "clip.wav"), str(a / "clip.flac"), "-f", "txt",
               "-o", str(tmp_path), *DEMO)
    assert out.returncode == 0, out.stderr
    got = _outputs(tmp_path)
    assert set(got) == {"a/clip.wav.txt", "a/clip.flac.txt", "b/clip.txt"}
    assert len(set(got.values())) == 3
    assert got["a/clip.wav.txt"] == "set an alarm for six forty five\n"
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "b" / "clip.txt").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.slow
def test_stdout_json_lines_and_prefixed_text(folder) -> None:
    inputs = [str(folder / "a" / "clip.wav"), str(folder / "a" / "corrupt.mp3"), str(folder / "b" / "clip.wav")]
    out = qasr("transcribe", *inputs, "-f", "json", *DEMO)
    assert out.returncode == 1
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [d["source"] for d in lines] == inputs  # input order, one line each, errors included
    assert lines[0]["text"] == "set an alarm for six forty five" and lines[1]["error"]
    out = qasr("transcribe", inputs[0], inputs[2], *DEMO)
    assert out.stdout.splitlines() == [f"{inputs[0]}: set an alarm for six forty five",
                                       f"{inputs[2]}: call anna on the ninth of july"]
    single = qasr("transcribe", inputs[0], "-f", "srt", *DEMO)
    assert single.stdout.startswith("1\n00:00:00,000 --> ") and "six forty five" in single.stdout


def test_usage_errors_come_before_any_work(folder, tmp_path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for args, needle in ((["-o", str(a_file)], "is not a folder"),
                         (["-f", "srt,json"], "need -o"),
                         (["-f", "doc"], "unknown format doc"),
                         (["--language", "Klingon"], "supported")):
        started = time.monotonic()
        out = qasr("transcribe", str(folder / "a" / "clip.wav"), *args, *DEMO)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and time.monotonic() - started < 20
    (tmp_path / "empty").mkdir()
    out = qasr("transcribe", str(tmp_path / "empty"), *DEMO)
    assert out.returncode == 1 and "no audio or video files" in out.stderr  # no input: README's exit 1
    out = qasr("transcribe", str(folder / "a" / "clip.wav"), "--language", "fr", *DEMO)
    assert out.returncode == 2 and "not supported by this model" in out.stderr and "English" in out.stderr


@pytest.mark.slow
def test_urls_and_pipes_closed_early(folder) -> None:
    out = qasr("transcribe", "https://example.com/talk.mp3", *DEMO)
    assert out.returncode == 1 and "URLs are not fetched" in out.stderr and "not found" not in out.stderr
    clips = [str(p) for p in sorted((folder / "b").glob("many*.wav"))]
    cmd = [sys.executable, "-m", "qasr", "transcribe", *clips, *DEMO]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        proc.stdout.readline()
        proc.stdout.close()  # like `| head -1`
        stderr = proc.stderr.read()
        proc.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


def test_help_answers_without_importing_torch() -> None:
    code = ("import sys, contextlib, io\nfrom qasr.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['transcribe', '--help'])\n    except SystemExit: pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_progress_bar_counts_audio_files_and_speed(folder, tmp_path) -> None:
    args = [a for a in DEMO if a != "--no-progress"]
    out = qasr("transcribe", str(folder / "a"), str(folder / "b" / "clip.wav"), "-o", str(tmp_path), "--progress",
               *args)
    assert out.returncode == 1  # a/corrupt.mp3
    last = out.stderr.replace("\r", "\n").splitlines()
    bars = [line for line in last if "s of audio" in line]
    assert bars and "100%" in bars[-1] and "4/4 files" in bars[-1] and "RTFx" in bars[-1], out.stderr


def test_progress_bar_counts_skipped_silence_as_done(folder, tmp_path) -> None:
    # 40 s of silence: VAD leaves none of it for the engine; the bar must still end at 100% of 42 s, not ~5%
    args = [a for a in DEMO if a != "--no-progress"]
    out = qasr("transcribe", str(folder / "b" / "silence.wav"), str(folder / "b" / "clip.wav"), "-o", str(tmp_path),
               "--progress", "--segmentation", "vad", *args)
    assert out.returncode == 0, out.stderr
    bars = [line for line in out.stderr.replace("\r", "\n").splitlines() if "s of audio" in line]
    assert bars and "100%" in bars[-1] and "2/2 files" in bars[-1], out.stderr


def test_missing_inputs_fail_before_the_model_loads(tmp_path) -> None:
    # the model path is wrong too: a run that loaded the model first would stop on it (exit 2, "checkpoint")
    out = qasr("transcribe", str(tmp_path / "nothere.wav"), str(tmp_path / "nor.mp3"), "-m", "/no/such/model",
               "-o", str(tmp_path / "out"), "--no-progress")
    assert out.returncode == 1, out.stderr
    assert f"qasr: error: {tmp_path / 'nothere.wav'}: file not found" in out.stderr
    assert "2 of 2 inputs failed" in out.stderr and "checkpoint" not in out.stderr
    assert (tmp_path / "out" / "failed.tsv").read_text().count("file not found") == 2


@pytest.mark.parametrize("model", ["/nonexistent", "./missing/model", "~/missing-model"])
def test_a_missing_local_model_path_is_reported_as_a_path(folder, model) -> None:
    out = qasr("transcribe", str(folder / "a" / "clip.wav"), "-m", model, "--no-progress", timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"qasr: error: model {model}: no such checkpoint directory" in out.stderr
    assert "Hugging Face" not in out.stderr and "HFValidationError" not in out.stderr
