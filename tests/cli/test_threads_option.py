"""``--threads N`` of ``qasr transcribe`` and ``qasr serve`` and ``ASR.from_pretrained(threads=N)``: the count
reaches the engine thread (torch's and OpenMP's), a bad value is refused before anything loads."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from qasr import ASR
from qasr.cli.main import build_parser, main
from qasr.engine.core import EngineCore
from qasr.engine.cpu.openmp import _runtime

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "qasr-demo-en"
ALARM = ROOT / "examples" / "alarm.flac"


@pytest.fixture
def engine_threads(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """(torch's, OpenMP's) thread count on the engine thread at each step; torch's count is restored after."""
    seen: list[tuple[int, int]] = []
    step = EngineCore.step

    def spy(self: EngineCore) -> None:
        lib = _runtime()  # OpenMP's first: torch's count, once asked, sets OpenMP's on this thread
        openmp = lib.omp_get_max_threads() if lib is not None else self.threads
        seen.append((torch.get_num_threads(), openmp))
        step(self)

    before, sigterm = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(EngineCore, "step", spy)
    yield seen
    torch.set_num_threads(before)
    signal.signal(signal.SIGTERM, sigterm)


def test_transcribe_threads_reach_the_engine(engine_threads: list, capsys: pytest.CaptureFixture) -> None:
    code = main(["transcribe", str(ALARM), "-m", str(DEMO), "--device", "cpu", "--dtype", "float32",
                 "--threads", "1"])
    assert code == 0 and capsys.readouterr().out == "set an alarm for seven thirty tomorrow\n"
    assert engine_threads and set(engine_threads) == {(1, 1)}


def test_asr_threads_argument(engine_threads: list) -> None:
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32", aligner=ROOT / "models" / "qasr-demo-aligner-en",
                              threads=1)
    try:
        assert asr._core.engine.threads == 1 and asr._core.aligner.engine.threads == 1
        assert asr.transcribe(str(ALARM))[0].text == "set an alarm for seven thirty tomorrow"
    finally:
        asr.close()
    assert engine_threads and set(engine_threads) == {(1, 1)}
    with pytest.raises(ValueError, match="EngineConfig.threads must be a positive integer, got 0"):
        ASR.from_pretrained("no/such/model", threads=0)  # refused before anything loads


@pytest.mark.parametrize("command", [["transcribe", "x.wav"], ["serve"]])
@pytest.mark.parametrize(("value", "message"), [("0", "argument --threads: must be at least 1, got 0"),
                                                ("two", "argument --threads: invalid positive_int value: 'two'")])
def test_a_bad_thread_count_is_refused(command: list[str], value: str, message: str,
                                       capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--threads", value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--threads", "3"]).threads == 3
    assert build_parser().parse_args(command).threads is None


def test_threads_with_ray_is_refused(capsys: pytest.CaptureFixture) -> None:
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["transcribe", str(ALARM), "--ray", "--threads", "2"]) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert "--threads sets this machine's engine; with --ray, --ray-actor-cpus" in capsys.readouterr().err
    assert main(["serve", "-m", str(DEMO), "--ray", "--threads", "2"]) == 2
    assert "with --ray, --ray-replica-cpus sets each replica's threads" in capsys.readouterr().err
