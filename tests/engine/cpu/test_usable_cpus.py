"""The engine's thread count: the CPUs a process may use (affinity and cgroup CPU quota, v1 and v2, read from
fake cgroup folders), EngineConfig.threads refused when not a positive count, and the default, which never
exceeds the usable CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import noise, prompt_for

from qasr.engine import core as engine_module
from qasr.engine.core import EngineCore
from qasr.engine.cpu.openmp import _runtime, cpu_quota, usable_cpus
from qasr.engine.engine import Engine, EngineConfig, RequestSpec

V2 = "0::/\n"
V1 = "4:memory:/\n2:cpu,cpuacct:/\n0::/\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


@pytest.mark.parametrize(("cpu_max", "quota", "cpus"), [
    ("max 100000", None, 8),  # unlimited
    ("200000 100000", 2.0, 2),
    ("150000 100000", 1.5, 1),  # rounded down
    ("50000 100000", 0.5, 1),  # at least one
    ("1600000 100000", 16.0, 8),  # the affinity is smaller
])
def test_cgroup_v2_cpu_max(tmp_path: Path, eight_cpus: None, cpu_max: str, quota: float | None, cpus: int) -> None:
    _write(tmp_path / "cpu.max", cpu_max)
    assert cpu_quota(tmp_path, V2) == quota
    assert usable_cpus(tmp_path, V2) == cpus


def test_cgroup_v2_nested_takes_the_tightest_on_the_way_up(tmp_path: Path, eight_cpus: None) -> None:
    _write(tmp_path / "system.slice" / "cpu.max", "300000 100000")
    _write(tmp_path / "system.slice" / "qasr.service" / "cpu.max", "max 100000")
    assert usable_cpus(tmp_path, "0::/system.slice/qasr.service\n") == 3
    # a container sees its own cgroup as the root: the folders its path names are not there
    _write(tmp_path / "cpu.max", "200000 100000")
    assert usable_cpus(tmp_path, "0::/kubepods/pod1/abc\n") == 2


def test_cgroup_v1_cfs_quota(tmp_path: Path, eight_cpus: None) -> None:
    _write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000")
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1")
    assert cpu_quota(tmp_path, V1) is None and usable_cpus(tmp_path, V1) == 8
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "250000")
    assert cpu_quota(tmp_path, V1) == 2.5 and usable_cpus(tmp_path, V1) == 2


def test_no_cgroup_files_leave_the_affinity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert usable_cpus(tmp_path, V1) == 3 and usable_cpus(tmp_path, "") == 3
    _write(tmp_path / "cpu.max", "garbage")
    assert usable_cpus(tmp_path, V2) == 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_engine_config_refuses_a_bad_thread_count(bad: object) -> None:
    with pytest.raises(ValueError, match="EngineConfig.threads must be a positive integer"):
        EngineConfig(threads=bad)  # type: ignore[arg-type]


@pytest.fixture
def torch_threads():  # noqa: ANN201 - the test's changes to torch's count are undone
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_engine_threads_default_and_setting(ck, monkeypatch: pytest.MonkeyPatch, torch_threads: None,
                                            caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(4)
    monkeypatch.setattr(engine_module, "usable_cpus", lambda: 2)
    engine = Engine(ck)
    assert engine.threads == 2 and torch.get_num_threads() == 2  # never more than the usable CPUs
    engine.close()
    monkeypatch.setattr(engine_module, "usable_cpus", lambda: 8)
    engine = Engine(ck)
    assert engine.threads == 2  # torch's own count (OMP_NUM_THREADS, a caller's setting) when lower
    engine.close()

    seen = []
    step = EngineCore.step

    def spy(self: EngineCore) -> None:
        lib = _runtime()  # OpenMP's first: torch's count, once asked, sets OpenMP's on this thread
        openmp = lib.omp_get_max_threads() if lib is not None else 1
        seen.append((torch.get_num_threads(), openmp))
        step(self)

    monkeypatch.setattr(EngineCore, "step", spy)
    caplog.set_level("INFO", logger="qasr")
    with Engine(ck, EngineConfig(threads=1)) as engine:
        assert engine.threads == 1 and f"qasr: {ck.label}: CPU threads: 1" in caplog.text
        wave = noise(1.0)
        engine.submit(RequestSpec(prompt_for(ck, wave), 2, waveform=wave)).result(timeout=60)
    assert seen and set(seen) == {(1, 1)}  # on the engine thread, torch's and OpenMP's counts
