"""Each exit status the README's table documents, through the real command (``python -m qasr``, the demo model)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys

import pytest
from server_proc import ALARM, DEMO_ARGS, ROOT, run_qasr

from qasr.cli import main as cli


@pytest.fixture(scope="module")
def long_inputs(tmp_path_factory) -> list[str]:
    """alarm.flac, then three copies of the 43 s briefing: work left after the first line is printed."""
    d = tmp_path_factory.mktemp("long")
    copies = [shutil.copy(ROOT / "examples" / "briefing.flac", d / f"briefing{k}.flac") for k in range(3)]
    return [str(ROOT / ALARM), *map(str, copies)]


def test_the_readme_documents_these_codes() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    table = text[text.index("Exit status:"):text.index("before it loads the model")]
    assert {int(code) for code in re.findall(r"\b(\d+) (?:when|for)\b", table)} == {0, 1, 2, 130, 141}
    assert (cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED, cli.EXIT_BROKEN_PIPE) == (1, 2, 130, 141)


def test_0_when_every_input_succeeded() -> None:
    out = run_qasr("transcribe", ALARM, *DEMO_ARGS)
    assert out.returncode == 0 and out.stdout == "set an alarm for seven thirty tomorrow\n", out.stderr


def test_1_when_an_input_failed(tmp_path) -> None:
    out = run_qasr("transcribe", ALARM, str(tmp_path / "gone.wav"), *DEMO_ARGS)
    assert out.returncode == 1, out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("qasr: error:")] == [
        f"qasr: error: {tmp_path / 'gone.wav'}: file not found"]


@pytest.mark.parametrize("kind", ["a missing file", "a folder without media"])
def test_1_when_no_input_exists_before_the_model_loads(tmp_path, kind: str) -> None:
    if kind == "a missing file":
        given, message = tmp_path / "gone.wav", f"{tmp_path / 'gone.wav'}: file not found"
    else:
        given, message = tmp_path / "empty", f"no audio or video files found in {tmp_path / 'empty'}"
        given.mkdir()
        (given / "notes.txt").write_text("not media\n")
    out = run_qasr("transcribe", str(given), "-m", "/no/such/model")  # loading the model would exit 2
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[0] == f"qasr: error: {message}"


@pytest.mark.parametrize(("args", "message"), [
    (["-f", "doc"], "unknown format doc"),
    (["--language", "Klingon"], "language 'Klingon' is not supported by this model; supported: English"),
    (["-o", "README.md"], "-o README.md: exists and is not a folder"),
    (["-m", "/no/such/model"], "model /no/such/model: no such checkpoint directory"),
    (["--output_format", "srt"], "unrecognized arguments: --output_format"),
])
def test_2_for_a_usage_error(args: list[str], message: str) -> None:
    out = run_qasr("transcribe", ALARM, *DEMO_ARGS, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_130_when_terminated(long_inputs) -> None:
    cmd = [sys.executable, "-m", "qasr", "transcribe", *long_inputs, *DEMO_ARGS, "--max-running", "1"]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().startswith(f"{long_inputs[0]}: set an alarm")
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "qasr: interrupted" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_141_when_stdout_closed_early(long_inputs) -> None:
    cmd = [sys.executable, "-m", "qasr", "transcribe", *long_inputs, *DEMO_ARGS]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        proc.stdout.readline()
        proc.stdout.close()  # `| head -1`
        stderr = proc.stderr.read()
        proc.wait(timeout=120)
    assert proc.returncode == 141, stderr
    assert "Traceback" not in stderr
