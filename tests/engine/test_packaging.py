"""The wheel and the sdist of this checkout hold every file of src/qasr, the kernels' C++ sources and headers
and the server's page included. Both are built by setuptools' PEP 517 hooks (what pip and `python -m build`
call) in a copy of the checkout, so nothing is written here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from qasr.engine.cpu import native

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TEST_ONLY_HEADERS = {"amx_emulate.h"}  # in tests/, included under QASR_AMX_EMULATE
# one hook per process, as a frontend calls them: setuptools keeps state between two calls
HOOK = "import sys; from setuptools import build_meta; print('built', getattr(build_meta, sys.argv[1])(sys.argv[2]))"


@dataclass(frozen=True)
class Dists:
    expected: set[str]  # files of the package, relative to src/
    wheel: set[str]
    sdist: set[str]  # relative to the sdist's top folder


def _package_files() -> set[str]:
    """The files of src/qasr: git's tracked and new ones, else every file but caches."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "src/qasr"],
                             cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
        paths = [ROOT / line for line in out.splitlines()]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in (SRC / "qasr").rglob("*") if "__pycache__" not in p.parts]
    return {p.relative_to(SRC).as_posix() for p in paths if p.is_file() and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    tmp = tmp_path_factory.mktemp("packaging")
    tree, out = tmp / "checkout", tmp / "dist"
    expected = _package_files()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        if (ROOT / name).exists():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    for rel in expected:
        (tree / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SRC / rel, tree / "src" / rel)
    out.mkdir()
    built = []
    for hook in ("build_wheel", "build_sdist"):
        run = subprocess.run([sys.executable, "-c", HOOK, hook, str(out)], cwd=tree, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        built.append(run.stdout.splitlines()[-1].split()[1])
    wheel_name, sdist_name = built
    with zipfile.ZipFile(out / wheel_name) as wheel:
        in_wheel = set(wheel.namelist())
    with tarfile.open(out / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        in_sdist = {m.name.removeprefix(f"{top}/") for m in sdist.getmembers() if m.isfile()}
    return Dists(expected, in_wheel, in_sdist)


def test_the_wheel_holds_every_file_of_the_package(dists: Dists) -> None:
    assert any(name.endswith(".h") for name in dists.expected)  # the headers the kernels include
    assert sorted(dists.expected - dists.wheel) == []


def test_the_sdist_holds_every_file_of_the_package(dists: Dists) -> None:
    assert sorted({f"src/{name}" for name in dists.expected} - dists.sdist) == []
    assert {"pyproject.toml", "README.md"} <= dists.sdist


def test_every_kernel_source_and_the_headers_it_includes_are_in_the_wheel(dists: Dists) -> None:
    """native.py's builds, each source with its quoted includes, followed through the headers."""
    csrc = "qasr/engine/cpu/csrc/"
    sources = {value[1] for value in vars(native).values()
               if isinstance(value, tuple) and len(value) == 3 and str(value[1]).endswith(".cpp")}
    assert {"decode_attention.cpp", "bf16_linear.cpp", "int8_linear.cpp"} <= sources
    todo, seen = list(sources), set()
    while todo:
        name = todo.pop()
        if name in seen or name in TEST_ONLY_HEADERS:
            continue
        seen.add(name)
        assert csrc + name in dists.wheel, f"{name} is not in the wheel"
        todo += re.findall(r'^\s*#\s*include\s+"([^"]+)"', (SRC / csrc / name).read_text(), re.M)
    assert any(name.endswith(".h") for name in seen)
