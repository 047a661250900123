"""The wheel list that scripts/gpu_check.sh installs on the GPU machine (scripts/gpu_wheels.py): pinned once
each, its wheels' own requirements met there, and nothing the GPU run imports left out."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
gw = importlib.util.module_from_spec(spec)
sys.modules["gpu_wheels"] = gw
spec.loader.exec_module(gw)

# what the GPU run executes, as far as it runs on a CPU: the parity tests' imports and oracle, the CUDA
# backend's tests, the GPU benchmark's both sides on a tiny checkpoint and its --device cuda entry point
GPU_RUN_TESTS = [
    "tests/model/test_transformers_parity.py::test_both_layouts_give_identical_output[cpu]",
    "tests/model/test_transformers_parity.py::test_logits_and_greedy_ids_match_transformers[cpu--None-1.0]",
    "tests/engine/cuda/test_cuda_backend.py::test_the_cuda_backend_on_cpu_tensors_gives_the_cpu_backends_tokens",
    # collected, skipped here:
    "tests/engine/cuda/test_cuda_backend.py::test_cuda_float32_engine_gives_the_cpu_engines_tokens",
    "tests/bench/test_bench_gpu.py::test_both_sides_run_on_a_tiny_checkpoint_and_the_report_renders",
    "tests/bench/test_bench_gpu.py::test_device_cuda_without_a_gpu_says_so",
]


def test_the_list_pins_each_wheel_once_and_the_command_is_the_device_notes_one() -> None:
    names = [gw.normalize(n) for n in gw.WHEELS]
    assert len(names) == len(set(names))
    for name, (version, why) in gw.WHEELS.items():
        assert all(c.isdigit() or c == "." for c in version), f"{name}: pin one exact version, got {version}"
        assert why
    cmd = gw.pip_command(Path("/x/.whl"), python="python3")
    assert cmd[:4] == ["python3", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    platforms = {cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"}
    assert platforms >= {"manylinux_2_17_x86_64", "manylinux2014_x86_64"}
    assert cmd[cmd.index("-d") + 1] == "/x/.whl"
    assert [a for a in cmd if "==" in a] == [f"{n}=={v}" for n, (v, _) in gw.WHEELS.items()]
    assert {"torch", "triton", "numpy", "safetensors", "tokenizers", "pytest"} <= gw.IMAGE


def _requirements(name: str, version: str) -> list[str] | None:
    """Requires-Dist of that exact version: from this environment, else from the downloaded wheel."""
    try:
        if importlib.metadata.version(name) == version:
            return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        pass
    for whl in gw.DEST.glob("*.whl") if gw.DEST.is_dir() else []:
        if gw.wheel_name(whl.name) == (gw.normalize(name), version):
            with zipfile.ZipFile(whl) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                text = z.read(meta).decode()
            return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return None


def test_each_wheels_requirements_are_met_on_the_device() -> None:
    reqs = {}
    for name, (version, _) in gw.WHEELS.items():
        found = _requirements(name, version)
        if found is None:
            pytest.skip(f"{name}=={version} is neither installed here nor in .whl/ (scripts/gpu_wheels.py)")
        reqs[name] = found
    assert gw.unmet(reqs) == []


def test_unmet_finds_what_neither_the_image_nor_the_list_meets() -> None:
    problems = gw.unmet({"x": ["tokenizers>=0.30", "no-such-package>=1", "regex>=2099.1", "torch>=2.4",
                               "pywin32; sys_platform == 'win32'", "pytest-cov; extra == 'dev'", "pyyaml>=5"]})
    assert len(problems) == 3, problems
    assert any("tokenizers" in p and "0.23.2" in p for p in problems)
    assert any("no-such-package" in p for p in problems) and any("regex" in p for p in problems)


def _wheel(folder: Path, name: str, size: int = 10) -> None:
    (folder / name).write_bytes(b"x" * size)


def test_check_dest_wants_each_listed_wheel_once_and_nothing_else(tmp_path) -> None:
    assert len(gw.check_dest(tmp_path)) == len(gw.WHEELS)  # all missing
    for name, (version, _) in gw.WHEELS.items():
        _wheel(tmp_path, f"{name}-{version}-py3-none-any.whl")
    assert gw.check_dest(tmp_path) == []
    _wheel(tmp_path, "transformers-5.0.0-py3-none-any.whl")  # two versions of one: the install would refuse
    _wheel(tmp_path, "av-18.1.0-cp312-cp312-manylinux_2_28_x86_64.whl", size=3 << 20)
    problems = gw.check_dest(tmp_path, limit_mib=2)
    assert any(p.startswith("transformers==") for p in problems)
    assert any(p.startswith("av ") and "not on the list" in p for p in problems)
    assert any("over the 2 MiB limit" in p for p in problems)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_wheel_folder_is_ignored_by_git() -> None:
    assert subprocess.run(["git", "check-ignore", "-q", ".whl/transformers-5.24.0-py3-none-any.whl"],
                          cwd=ROOT).returncode == 0


@pytest.mark.slow
def test_the_gpu_run_imports_nothing_the_device_lacks(tmp_path) -> None:
    """The GPU run's code, run here in a Python that sees only the standard library, qasr's source and the
    packages on the device image or in the wheel list: it passes."""
    pytest.importorskip("transformers")
    linked = gw.image_site(tmp_path / "site")
    assert {"torch", "numpy", "pytest", "transformers", "regex"} <= set(linked)
    assert "soundfile" not in linked and "av" not in linked  # qasr's decoders stay behind
    path = [str(tmp_path / "site"), str(ROOT / "src"), str(ROOT / "tests")]
    code = (f"import sys; sys.path[:0] = {path!r}; import pytest; "
            f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', *{GPU_RUN_TESTS!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("no CUDA device" in line for line in skips), run.stdout[-2000:]  # only the CUDA cases
    assert f"{len(GPU_RUN_TESTS) - len(skips)} passed" in run.stdout, run.stdout[-2000:]
