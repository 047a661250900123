"""``qasr transcribe`` shows a long file's text as it happens: txt on stdout grows segment by segment, and a
txt output file is preceded by NAME.txt.partial (growing, then removed); the final bytes are unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from server_proc import qasr_command

from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
DEMO = ("-m", str(ROOT / "models" / "qasr-demo-en"), "--device", "cpu", "--dtype", "float32", "--no-progress",
        "--max-running", "2", "--max-segment-s", "4")  # two segments at a time: the text comes in waves
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights", "remind me to buy milk tomorrow", "what is the weather like today")


@pytest.fixture(scope="module")
def long_wav(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("progressive")
    parts = []
    for k in range(16):
        wave, sr = sf.read(speak(SENTENCES[k % len(SENTENCES)], d / "s.wav", speed=150 + 5 * k), dtype="float32")
        parts += [soxr.resample(wave, sr, SR).astype(np.float32), np.zeros(SR, np.float32)]
    sf.write(d / "talk.wav", np.concatenate(parts), SR)
    return d / "talk.wav"


def size_now(path: Path) -> int | None:
    """The file's size, or None when it is not there (the run may remove it between any two calls)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(qasr_command("transcribe", *args, *DEMO), cwd=ROOT,  # Ctrl-C reaches it
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_txt_file_grows_as_partial_then_is_written_whole(long_wav, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(str(long_wav), "-o", str(out))
    partial, final = out / "talk.txt.partial", out / "talk.txt"
    sizes = []
    while proc.poll() is None:
        size = size_now(partial)
        if size is not None and not final.exists():
            sizes.append(size)
        time.sleep(0.01)
    assert proc.returncode == 0, proc.stderr.read().decode()
    grown = sorted(set(sizes) - {0})  # 0: caught between the file's creation and its first write
    assert len(grown) >= 3, sizes  # the partial grew in several steps before the file was written
    assert final.read_text().strip() and not partial.exists()
    stdout_run = start(str(long_wav))  # the same text on stdout, first bytes while it still runs
    first = os.read(stdout_run.stdout.fileno(), 1 << 16)
    still_running = stdout_run.poll() is None
    rest = stdout_run.stdout.read()
    assert stdout_run.wait(300) == 0
    assert first.strip() and still_running
    assert (first + rest).decode() == final.read_text()  # same bytes as the whole printed at once


@pytest.mark.slow
def test_an_interrupted_run_leaves_no_partial_file(long_wav, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(str(long_wav), "-o", str(out))
    partial = out / "talk.txt.partial"
    deadline = time.monotonic() + 120
    while not size_now(partial):
        assert proc.poll() is None and time.monotonic() < deadline, "no partial text appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(60) == 130
    assert not partial.exists() and not (out / "talk.txt").exists()
