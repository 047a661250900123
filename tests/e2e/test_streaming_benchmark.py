"""benchmarks/streaming.py's --quantize: every mode is a choice, and each run's label and the output files
name the modes run, so no quantized figure can be read as the bf16 one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qasr.engine.config import QUANTIZE_MODES

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "streaming.py"


def load():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("streaming_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_labels_and_file_suffix_name_the_modes_run() -> None:
    mod = load()
    assert mod.run_label("0.6b dims", "none") == "0.6b dims"
    for mode in QUANTIZE_MODES:
        assert mod.run_label("0.6b dims", mode) == f"0.6b dims, {mode}"
    assert mod.quantize_suffix(["none"]) == ""
    assert mod.quantize_suffix(["none", "int8"]) == "_int8"  # the name docs/bench's int8 files already have
    assert mod.quantize_suffix(["int4"]) == "_int4"
    assert mod.quantize_suffix(["none", "int8", "int4"]) == "_int8_int4"


def test_every_quantize_mode_is_a_choice_and_others_are_refused(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as bad:  # refused while parsing, before any model is built
        load().main(["--quantize", "int2"])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int2'" in err and all(f"'{mode}'" in err for mode in QUANTIZE_MODES)
