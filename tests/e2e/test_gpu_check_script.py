"""scripts/gpu_check.sh, the one script a session with a lent GPU runs: its syntax, its stages and budgets
(dry run), and its bookkeeping on a real run with a stand-in interpreter (a hanging stage costs its budget
and the later stages still run and are recorded)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def _stages(out: str) -> list[tuple[str, int, str]]:
    return [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^stage (\w+) \(budget (\d+) s\): (.*)$", out, re.M)]


@pytest.mark.parametrize(("quick", "limit"), [(False, 470), (True, 270)])
def test_dry_run_lists_the_stages_within_eight_minutes(tmp_path, quick: bool, limit: int) -> None:
    r = run("--dry-run", *(["--quick"] if quick else []), env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    stages = _stages(r.stdout)
    assert [s for s, _, _ in stages] == ["env", "install", "tests", "bench"]
    assert sum(b for _, b, _ in stages) <= limit <= 480 and f"at most {limit} s" in r.stdout
    cmd = {s: c for s, _, c in stages}
    assert "_flash_attention_forward" in cmd["env"]
    assert "pip install" in cmd["install"] and "--no-index --no-deps" in cmd["install"]
    assert "--target /tmp/site .whl/*.whl" in cmd["install"]
    assert "-m pytest" in cmd["tests"] and "-k cuda" in cmd["tests"]
    assert "tests/engine/cuda/test_cuda_backend.py" in cmd["tests"]
    assert ("tests/model/test_transformers_parity.py" in cmd["tests"]) is not quick
    assert "benchmarks/throughput.py --device cuda" in cmd["bench"] and f"--out {tmp_path}" in cmd["bench"]
    assert "PYTHONPATH=/tmp/site:" in r.stdout and f"{ROOT}/src" in r.stdout
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def _budget_table() -> dict[str, list[tuple[str, int, int]]]:
    """The header's bench budget table: kind -> [(what, full s, quick s)]."""
    table: dict[str, list[tuple[str, int, int]]] = {}
    text = SCRIPT.read_text()
    for m in re.finditer(r"^#   (fixed|inner|total|bench stage budget)\s+(.*?)\s*(\d+) \|\s+(\d+)$", text, re.M):
        table.setdefault(m[1], []).append((m[2], int(m[3]), int(m[4])))
    return table


@pytest.mark.parametrize("quick", [False, True])
def test_the_bench_stage_fits_its_budget_with_a_margin(tmp_path, quick: bool) -> None:
    """The header's table adds up, its inner budgets are the ones the bench command passes (and the plan's
    invariance budget), and inner budgets plus the stated fixed costs stay under 90% of the stage's budget,
    so the transformers side and the summary line are not cut off by the stage's timeout."""
    from qasr.bench.gpu import QUICK, GpuPlan

    col = 2 if quick else 1
    table = _budget_table()
    assert len(table["fixed"]) >= 6 and len(table["inner"]) == 3, table
    fixed = sum(row[col] for row in table["fixed"])
    inner = {row[0].split()[0]: row[col] for row in table["inner"]}
    total = table["total"][0][col]
    stage = table["bench stage budget"][0][col]
    assert fixed + sum(inner.values()) == total

    r = run("--dry-run", *(["--quick"] if quick else []), env={"OUT": str(tmp_path)})
    stages = {s: (b, c) for s, b, c in _stages(r.stdout)}
    budget, cmd = stages["bench"]
    assert budget == stage
    levels = [float(x) for x in re.search(r"--gpu-budgets ([\d.,]+)", cmd)[1].split(",")]
    reference = float(re.search(r"--gpu-reference-budget ([\d.]+)", cmd)[1])
    plan = QUICK if quick else GpuPlan()
    assert len(levels) == len(plan.levels)
    assert inner == {"levels": sum(levels), "transformers": reference, "batch": plan.invariance_budget_s}
    assert total <= 0.9 * budget, f"bench: {total} s of {budget} s"
    assert levels[-1] == 0  # concurrency 512 (2-minute clips, 512 at once) cannot finish in a short run


def test_unknown_arguments_are_refused() -> None:
    r = run("--bogus")
    assert r.returncode == 2 and "unknown argument" in r.stderr


STAND_IN = """#!/usr/bin/env bash
case "$1 $2" in
  "-m pytest") sleep 30 ;;
  "-m pip") echo "installed" ;;
  "benchmarks/throughput.py --device") echo "bench ran with: $*" ;;
  *) echo "python $*" ;;
esac
"""


@pytest.mark.slow
def test_a_hanging_stage_costs_its_budget_and_every_stage_is_recorded(tmp_path) -> None:
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = run(env={"PYTHON": str(python), "OUT": str(out), "GPU_CHECK_SITE": str(tmp_path / "site"),
                 "GPU_CHECK_BUDGETS": "env=10,install=10,tests=5,bench=10"})
    assert time.perf_counter() - t0 < 30
    assert r.returncode == 1  # a stage failed
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    assert rows[0] == ["stage", "rc", "seconds", "budget_s"]
    result = {row[0]: row for row in rows[1:]}
    assert list(result) == ["env", "install", "tests", "bench"]
    assert result["install"][1] == "0" and result["bench"][1] == "0", (out / "gpu_check.log").read_text()
    assert result["tests"][1] == "124" and int(result["tests"][2]) <= 8
    log = (out / "gpu_check.log").read_text()
    assert "=== stage tests: exit 124" in log and "time budget spent" in log
    assert f"bench ran with: benchmarks/throughput.py --device cuda --out {out}" in log
    assert (out / "env.txt").exists()


def test_amx_mode_checks_the_host_cpu_alone(tmp_path) -> None:
    r = run("--dry-run", "--amx", env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    stages = _stages(r.stdout)
    assert [s for s, _, _ in stages] == ["env", "amx"]
    assert sum(b for _, b, _ in stages) <= 180 and "at most 180 s" in r.stdout
    cmd = dict((s, c) for s, _, c in stages)["amx"]
    assert "grep -qw amx_bf16 /proc/cpuinfo" in cmd and "QASR_NO_NATIVE=0" in cmd
    assert "tests/engine/cpu/test_amx_linear.py" in cmd and f"scripts/amx_rates.py --threads 2 --out {tmp_path}" in cmd


def test_the_amx_stage_runs_here(tmp_path) -> None:
    """The stage's own command on this machine (the env stage fails here: no GPU); on a CPU without AMX it
    passes with a note, on one with AMX it runs the real kernel tests and rates."""
    out = tmp_path / "out"
    r = run("--amx", env={"PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_BUDGETS": "env=5,amx=170"},
            timeout=200)
    rows = {row.split("\t")[0]: row.split("\t") for row in (out / "stages.tsv").read_text().splitlines()[1:]}
    assert list(rows) == ["env", "amx"]
    log = (out / "gpu_check.log").read_text()
    assert rows["amx"][1] == "0", log
    if "amx_bf16" in Path("/proc/cpuinfo").read_text():
        assert (out / "amx_rates.json").exists() and "passed" in log
    else:
        assert "this host CPU has no amx_bf16: nothing to check" in log
    assert r.returncode == (0 if rows["env"][1] == "0" else 1)
