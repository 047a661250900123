"""scripts/house_figures.py --check, the lint step that keeps the lab notebook out of src/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "house_figures.py"


@pytest.fixture(scope="module")
def house():
    spec = importlib.util.spec_from_file_location("house_figures", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("line", [
    "# measured on 2 Zen 4 cores: 41 -> 68 ms",
    "# on the AMX Xeon of docs/kernels.md this ran 2x faster",
    "# (2026-12-03) the int8 path",
    "# this session's kernel",
    "# tried and not kept: a SLEEF exp",
])
def test_a_planted_notebook_comment_is_found(house, tmp_path: Path, line: str) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(f'"""A module."""\n\nX = 1  {line}\n', encoding="utf-8")
    house.ROOT = tmp_path
    assert [f.split(":")[1] for f in house.notebook_lines([planted])] == ["3"]


def test_notebook_words_in_code_and_strings_are_not_prose(house, tmp_path: Path) -> None:
    clean = tmp_path / "clean.py"
    clean.write_text('"""Cuts a file at its quiet points."""\n\nTODAY = "today"  # the key the client sends\n'
                     'def f() -> str:\n    """Return the word."""\n    return "measured on Xeon"\n', encoding="utf-8")
    cpp = tmp_path / "kernel.cpp"
    cpp.write_text('// Batch-invariant linear layer for CPUs with AVX512-BF16.\nconst char* s = "EPYC";\n'
                   '// rows of 16: see docs/log/2026-12-03-cpu-tiles.md\n',
                   encoding="utf-8")
    house.ROOT = tmp_path
    assert house.notebook_lines([clean, cpp]) == []


def test_a_planted_cpp_comment_is_found(house, tmp_path: Path) -> None:
    cpp = tmp_path / "kernel.cpp"
    cpp.write_text("int x;\n/* a block:\n   measured on an EPYC, 230 GOP/s */\n", encoding="utf-8")
    house.ROOT = tmp_path
    assert [f.split(":")[1] for f in house.notebook_lines([cpp])] == ["3"]


def test_check_exits_1_on_a_planted_line_in_src(tmp_path: Path) -> None:
    """The command make lint runs, on a copy of the script that looks at a planted tree."""
    src = tmp_path / "src" / "qasr"
    src.mkdir(parents=True)
    (src / "mod.py").write_text('"""A module."""\n', encoding="utf-8")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "house_figures.py").write_text(SCRIPT.read_text(encoding="utf-8"), encoding="utf-8")
    run = [sys.executable, str(scripts / "house_figures.py"), "--check"]
    assert subprocess.run(run, capture_output=True, text=True).returncode == 0
    (src / "mod.py").write_text('"""A module."""\n\nN = 8  # best on the Xeon today\n', encoding="utf-8")
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 1 and "src/qasr/mod.py:3" in done.stderr
