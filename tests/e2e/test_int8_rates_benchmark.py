"""benchmarks/int8_rates.py: every path that can run here is measured and written, best round per path."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from qasr.engine.cpu import native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "int8_rates.py"


def load():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("int8_rates", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rates_name_every_path_and_keep_the_best_round(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    mod = load()
    monkeypatch.setattr(mod, "SHAPES", ((1, 64, 96), (3, 100, 70)))
    assert mod.main(["--threads", "1", "--repeats", "1", "--min-seconds", "0", "--rounds", "2",
                     "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "int8_rates.json").read_text())
    found = {"amx_int8": native.amx_int8_kernel(), "vnni_int8": native.vnni_int8_kernel(),
             "avx_vnni_int8": native.avx_vnni_int8_kernel(), "vnni_int4": native.int4_kernel(),
             "bf16": native.linear_kernel()}
    expected = {name for name, k in found.items() if k is not None}
    assert set(result["kernels"]) == expected and result["threads"] == 1 and len(result["rates_by_round"]) == 2
    assert [r["shape"] for r in result["rates"]] == [[1, 64, 96], [3, 100, 70]]
    for i, row in enumerate(result["rates"]):
        assert set(row["gops"]) == {"torch_ref", *expected} and all(v > 0 for v in row["gops"].values())
        for path, best in row["gops"].items():
            assert best == max(rnd[i]["gops"][path] for rnd in result["rates_by_round"])
    assert "weight_gbs" in result["rates"][0] and "weight_gbs" not in result["rates"][1]
