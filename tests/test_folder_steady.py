"""Many inputs in one call finish steadily, in input order: at most a batch's worth of pieces is submitted
and unfinished at once (the engine's ``max_running`` and a quarter more), so the inputs go through the
engine in order and an interrupt loses only those in flight; counted in engine steps and pieces here,
and for a real folder job interrupted by SIGINT at half its time.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import soundfile as sf
import soxr
from server_proc import qasr_command

from qasr import ASR
from qasr.engine.config import EngineConfig
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "qasr-demo-en"
SR = 16000
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "the code is k four z nine",
             "turn off the lights", "remind me to buy milk tomorrow", "what is the weather like today")
RUNNING = 4


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> list[np.ndarray]:
    d = tmp_path_factory.mktemp("steady")
    out = []
    for k, text in enumerate(SENTENCES):
        wave, sr = sf.read(speak(text, d / "s.wav", speed=150 + 7 * k), dtype="float32")
        out.append(soxr.resample(wave, sr, SR).astype(np.float32))
    return out


def _input(sentences: list[np.ndarray], k: int, n: int) -> np.ndarray:
    """n sentences with 1 s pauses (one 4 s segment each, about)."""
    pause = np.zeros(SR, np.float32)
    return np.concatenate([part for j in range(n) for part in (sentences[(k + j) % len(sentences)], pause)])


def test_inputs_finish_in_order_with_a_batch_in_flight(sentences) -> None:
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32", engine=EngineConfig(max_running=RUNNING))
    try:
        window = asr.max_in_flight_pieces
        assert RUNNING < window <= RUNNING + RUNNING // 2 + 2  # the batch stays full, and little more waits
        inputs = [(_input(sentences, k, 1 + k % 3), SR) for k in range(16)]
        lock = threading.Lock()
        in_flight, most, started = [0], [0], {}
        submit = asr.submit

        def counting(piece, **kwargs):  # noqa: ANN001, ANN202 - ASR.submit's own signature
            fut = submit(piece, **kwargs)
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
                started.setdefault(piece.item, asr.engine.steps)

            def settled(_) -> None:  # noqa: ANN001
                with lock:
                    in_flight[0] -= 1
            fut.add_done_callback(settled)
            return fut

        asr.submit = counting  # type: ignore[method-assign]
        step0 = asr.engine.steps
        done: dict[int, int] = {}
        for i, result in asr.transcribe_iter(inputs, segmentation="vad", max_segment_s=4):
            assert result.error is None and result.text
            done[i] = asr.engine.steps - step0
    finally:
        asr.close()
    assert most[0] <= window, f"{most[0]} pieces were in flight at once; the window is {window}"
    # the inputs went through in order: the last one was only started (decoded, segmented, submitted) once
    # the first ones had finished, and in engine steps the inputs finished in input order, give or take
    # the few that share the batch (an input may overtake one begun at most a window's pieces before it)
    order = sorted(done, key=lambda i: done[i])
    assert started[15] - step0 >= done[0] > 0
    for rank, i in enumerate(order):
        assert abs(rank - i) <= 2, f"inputs finished in the order {order}"


def _outputs(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _run_measured(cmd: list[str], stop_at_cpu_s: float | None = None) -> tuple[subprocess.Popen, float]:
    """Run ``cmd``; its CPU seconds when it ended, or SIGINT once it has used ``stop_at_cpu_s`` of them.
    CPU time, not wall time: the machines that run the tests are shared, and a neighbour's load stretches
    wall time by 2x or more from one run to the next, while the job's own work stays what it is."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watch = psutil.Process(proc.pid)
    used = 0.0
    while proc.poll() is None:
        try:
            used = _cpu_s(watch)
        except psutil.NoSuchProcess:
            break
        if stop_at_cpu_s is not None and used >= stop_at_cpu_s:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    return proc, used


def test_folder_job_interrupted_late_has_written_its_first_inputs(tmp_path, sentences) -> None:
    """A folder of 40 inputs (10-25 s each: about 140 pieces) on the demo model with its defaults (a batch of
    64 running), interrupted at three quarters of its time: the first inputs are written; rerunning
    finishes the rest with the same bytes. The code before the window, which decoded and segmented every
    input while the engine ran its first batch, had written none by then (2-4 with it, here)."""
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(40):
        sf.write(folder / f"in{k:02d}.wav", _input(sentences, k, 3 + k % 5), SR)
    args = ("transcribe", str(folder), "-f", "json,srt", "-m", str(DEMO), "--device", "cpu", "--no-progress")
    full = tmp_path / "full"
    done, cpu = _run_measured(qasr_command(*args, "-o", str(full)))
    assert done.wait(600) == 0, done.stderr.read()  # type: ignore[union-attr]
    assert len(_outputs(full)) == 80

    part = tmp_path / "part"
    proc, _ = _run_measured(qasr_command(*args, "-o", str(part)), stop_at_cpu_s=cpu * 3 / 4)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, f"the job was not interrupted before its end\n{stderr}"
    written = sorted(int(n[2:4]) for n in _outputs(part) if n.endswith(".json"))
    # not three quarters: the model's load and the first batch's latency (a piece decodes for ~30 steps of the
    # run's ~100) come before any input can finish, and then a batch's worth of inputs finishes together
    assert written, f"nothing written at 3/4 time ({cpu:.1f} CPU seconds)\n{stderr}"
    assert max(written) < 20, f"{written} written at 3/4 time: not the first inputs"
    first = _outputs(part)
    for name, data in first.items():
        assert data == _outputs(full)[name], name
    again = subprocess.run(qasr_command(*args, "-o", str(part)), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert "already have their outputs; skipping them" in again.stderr
    assert _outputs(part) == _outputs(full)
