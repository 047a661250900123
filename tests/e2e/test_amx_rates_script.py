"""scripts/amx_rates.py: the GEMM-rate probe the AMX check runs on a lent machine's host CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from qasr.engine.cpu import native

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "amx_rates.py"


def load():
    spec = importlib.util.spec_from_file_location("amx_rates", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rates_name_every_kernel_that_passed_its_self_test(tmp_path, monkeypatch) -> None:
    mod = load()
    monkeypatch.setattr(mod, "SHAPES", ((16, 256, 512), (3, 128, 96)))
    out = tmp_path / "rates.json"
    assert mod.main(["--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    expected = [name for name, k in (("amx", native.amx_kernel()), ("avx512", native.avx512_kernel()))
                if k is not None]
    assert result["kernels"] == sorted(expected) and result["threads"] == 1
    assert [r["shape"] for r in result["rates"]] == [[16, 256, 512], [3, 128, 96]]
    for row in result["rates"]:
        assert set(row["gflops"]) == {"torch", *expected} and all(v > 0 for v in row["gflops"].values())
