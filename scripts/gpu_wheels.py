"""The wheels the GPU check carries to the device machine: ONE list, downloaded here into .whl/.

The lent GPU machine (nvidia-h200, this workplace's image 'cuda', Python 3.12) reaches no package registry.
Its image already holds torch 2.11 with CUDA, Triton, numpy, safetensors, tokenizers, pytest, matplotlib and
the rest of IMAGE below (read off the workplace's device notes, KINDS.md, as listed on 2026-11-17), so
qasr runs there from its source tree (PYTHONPATH=src). What the GPU run needs beyond that travels in the
working tree as wheels, in .whl/ (git-ignored), and scripts/gpu_check.sh installs them with
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.

What the GPU run imports is checked by the tests (tests/e2e/test_gpu_wheels_script.py): its code runs on CPU in a
Python that sees only the standard library, qasr, and the packages of IMAGE and WHEELS (``image_site``),
and each wheel's own requirements must be met by IMAGE (at the versions known there) or by WHEELS. qasr's
audio decoders (PyAV, soundfile, soxr) are not on that path: the benchmark and the tests make their audio
in memory.

    python scripts/gpu_wheels.py            # download into .whl/, then check it
    python scripts/gpu_wheels.py --check    # only check .whl/ (every wheel once, nothing else, the size)
    python scripts/gpu_wheels.py --print    # the pip command
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".whl"
LIMIT_MIB = 24.0  # the working tree travels whole (64 MiB with the wheels): keep them far under that

# distribution -> (exact version, why it travels)
WHEELS: dict[str, tuple[str, str]] = {
    "transformers": ("5.24.0", "the parity oracle and the benchmark's reference: qwen3_asr arrived in 5.24; "
                               "the image has 5.17"),
    "regex": ("2026.11.19", "transformers checks regex>=2025.10.22 at import; the image's version is not known"),
}

# the image's versions where the device notes give them (others: present, version not read)
IMAGE_VERSIONS: dict[str, str] = {
    "torch": "2.11.0", "triton": "3.6.0", "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0", "transformers": "5.17.0", "accelerate": "1.15.0", "torchaudio": "2.11.0",
    "sentencepiece": "0.2.2", "onnxruntime": "1.30.0",
}

IMAGE: frozenset[str] = frozenset("""
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-
    pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-
    cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
    optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-
    image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp
""".split())

PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -, _ and . as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_command(dest: Path = DEST, python: str = sys.executable) -> list[str]:
    """The device notes' download command, for every wheel of the list in one call."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
           "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "-d", str(dest), *(f"{name}=={version}" for name, (version, _) in WHEELS.items())]


def wheel_name(filename: str) -> tuple[str, str]:
    """(normalized distribution, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def check_dest(dest: Path = DEST, limit_mib: float = LIMIT_MIB) -> list[str]:
    """Problems with a wheel folder: a listed wheel missing or at another version, a wheel not on the list
    (two versions of one stop the whole install there), the total over the limit. Empty when fine."""
    problems = []
    files = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    found: dict[str, list[str]] = {}
    for f in files:
        name, version = wheel_name(f.name)
        found.setdefault(name, []).append(version)
    wanted = {normalize(n): v for n, (v, _) in WHEELS.items()}
    for name, version in wanted.items():
        if found.get(name) != [version]:
            problems.append(f"{name}=={version}: found {found.get(name, 'nothing')}")
    for name, versions in found.items():
        if name not in wanted:
            problems.append(f"{name} {versions}: not on the list (remove it)")
    total = sum(f.stat().st_size for f in files) / 2**20
    if total > limit_mib:
        problems.append(f"the wheels take {total:.1f} MiB, over the {limit_mib:g} MiB limit")
    return problems


def unmet(requirements: dict[str, list[str]]) -> list[str]:
    """Requirements (distribution -> its Requires-Dist lines) of the listed wheels that neither the image
    nor the list meets, for CPython 3.12 on Linux; extras are ignored. Where the image's version is not
    known, being there counts as met."""
    from packaging.requirements import Requirement

    env = {"python_version": PYTHON, "python_full_version": PYTHON + ".3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    listed = {normalize(n): v for n, (v, _) in WHEELS.items()}
    image = {normalize(n) for n in IMAGE}
    known = {normalize(n): v for n, v in IMAGE_VERSIONS.items()}
    problems = []
    for dist, lines in requirements.items():
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = normalize(req.name)
            if name in listed:
                ok = req.specifier.contains(listed[name], prereleases=True)
                where = f"the list's {listed[name]}"
            elif name in image:
                ok = name not in known or req.specifier.contains(known[name], prereleases=True)
                where = f"the image's {known.get(name, '(version not known)')}"
            else:
                ok, where = False, "neither the image nor the list"
            if not ok:
                problems.append(f"{dist} needs {req}: {where}")
    return problems


def image_site(dest: Path) -> list[str]:
    """Make ``dest`` a site folder holding only what the device would have: links to the top-level
    modules and metadata of every distribution installed here that is in IMAGE or WHEELS, and of what
    those require (this environment's versions of image packages may need other helpers than the image's
    versions; the image brings its own). A Python run with ``-S`` and ``dest`` (plus qasr's src/) on its
    path then finds nothing else, as on the device. Returns the distributions linked."""
    import importlib.metadata

    from packaging.requirements import Requirement

    installed = {normalize(d.metadata["Name"] or ""): d for d in importlib.metadata.distributions()}
    todo = [n for n in {normalize(n) for n in IMAGE} | {normalize(n) for n in WHEELS} if n in installed]
    keep: set[str] = set()
    while todo:
        name = todo.pop()
        if name in keep or name == "qasr":
            continue
        keep.add(name)
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if normalize(req.name) in installed:
                todo.append(normalize(req.name))
    dest.mkdir(parents=True, exist_ok=True)
    for name in keep:
        dist = installed[name]
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source, link = base / top, dest / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return sorted(keep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--check", action="store_true", help="only check the folder")
    p.add_argument("--print", action="store_true", help="print the pip command and exit")
    args = p.parse_args(argv)
    cmd = pip_command(args.dest)
    if args.print:
        print(" ".join(cmd))
        return 0
    if not args.check:
        args.dest.mkdir(exist_ok=True)
        wanted = {normalize(n): v for n, (v, _) in WHEELS.items()}
        for f in args.dest.glob("*.whl"):  # a wheel of an older list would make the install refuse both
            if wheel_name(f.name) not in wanted.items():
                f.unlink()
        subprocess.run(cmd, check=True)
    problems = check_dest(args.dest)
    for line in problems:
        print(f"problem: {line}")
    total = sum(f.stat().st_size for f in args.dest.glob("*.whl")) / 2**20 if args.dest.is_dir() else 0
    print(f"{args.dest}: {len(list(args.dest.glob('*.whl'))) if args.dest.is_dir() else 0} wheels, {total:.1f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
