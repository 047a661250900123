"""The command line, run as a real subprocess: ``python -m qasr``, exactly what the ``qasr`` script runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qasr import __version__
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
FLOAT32 = ("--device", "cpu", "--dtype", "float32")  # exact text on every CPU (bf16 rounding differs by CPU)


def run(*args: str, module: str = "qasr") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return [speak("hello there", d / "one.wav"), speak("good morning", d / "two.wav")]


def test_help_and_version() -> None:
    out = run("--help")
    assert out.returncode == 0 and "transcribe" in out.stdout
    out = run("transcribe", "--help")
    assert out.returncode == 0 and "--language" in out.stdout and "--output-dir" in out.stdout
    assert "ceil(15 x seconds) + 24" in " ".join(out.stdout.split())
    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"qasr {__version__}\n"
    assert run("--version", module="qasr.cli").stdout == out.stdout  # the old spelling still works


def test_python_m_qasr_transcribes_an_example() -> None:
    out = run("transcribe", "examples/alarm.flac", "-m", "models/qasr-demo-en", *FLOAT32)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "set an alarm for seven thirty tomorrow\n" and out.stderr == ""


def test_a_cut_piece_warns_and_says_so_in_json(tmp_path) -> None:
    out = run("transcribe", "examples/alarm.flac", "-m", "models/qasr-demo-en", *FLOAT32, "--max-new-tokens", "2",
              "-f", "json", "-o", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "qasr: warning: examples/alarm.flac: the piece at 0.0 s was cut at max_new_tokens=2; "
        "its text may be incomplete"]
    data = json.loads((tmp_path / "alarm.json").read_text())
    assert data["finish_reason"] == "length" and data["segments"][0]["finish_reason"] == "length"


def test_text_to_stdout(tiny_original, clips) -> None:
    out = run("transcribe", *map(str, clips), "-m", str(tiny_original), "--device", "cpu",
              "--dtype", "float32", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2


def test_json_files_to_output_dir(tiny_original, clips, tmp_path) -> None:
    out = run("transcribe", *map(str, clips), "-m", str(tiny_original), "-f", "json", "-o", str(tmp_path),
              "--language", "en", "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    data = json.loads((tmp_path / "one.json").read_text())
    assert data["language"] == "English" and data["error"] is None and data["duration"] > 0.3
    assert data["finish_reason"] in ("stop", "length")
    assert (tmp_path / "two.json").exists()
    assert not list(tmp_path.glob(".*.part"))


def test_failed_input_exits_nonzero_with_one_message(tiny_original, clips, tmp_path) -> None:
    missing = tmp_path / "nope.wav"
    out = run("transcribe", str(clips[0]), str(missing), "-m", str(tiny_original), "--max-new-tokens", "3",
              "--device", "cpu", "--dtype", "float32")
    assert out.returncode == 1
    assert len(out.stdout.splitlines()) == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("qasr: error")]
    assert len(errors) == 1 and "nope.wav" in errors[0]


def test_bad_language_and_missing_model(tmp_path) -> None:
    clip = speak("hello", tmp_path / "x.wav")  # an input that exists: a missing one fails before the model
    out = run("transcribe", str(clip), "-m", "/no/such/model")
    assert out.returncode == 2 and "/no/such/model" in out.stderr
    out = run("transcribe", "x.wav", "--language", "Klingon")
    assert out.returncode == 2 and "supported" in out.stderr
