"""``qasr serve MODEL``: the model positionally (as ``vllm serve MODEL``), or by ``-m/--model``; both given
and different is a usage error (exit 2) before anything loads."""

from __future__ import annotations

import pytest

from qasr.cli.main import build_parser, main
from qasr.cli.serve import DEFAULT_MODEL, server_config


@pytest.mark.parametrize(("argv", "model"), [
    (["serve", "models/x"], "models/x"),
    (["serve", "-m", "models/x"], "models/x"),
    (["serve", "--model", "models/x", "--port", "0"], "models/x"),
    (["serve", "--port", "0", "models/x"], "models/x"),
    (["serve", "models/x", "-m", "models/x"], "models/x"),
    (["serve", "--ray", "Qwen/Qwen3-ASR-1.7B"], "Qwen/Qwen3-ASR-1.7B"),  # not a Ray address: the model
    (["serve"], DEFAULT_MODEL),
])
def test_the_model_is_taken_either_way(argv, model) -> None:
    from qasr.cli.ray_options import split_ray_address

    config = server_config(build_parser().parse_args(split_ray_address(argv)))
    assert config.model == model
    assert config.served_names[0] == model


def test_two_different_models_are_a_usage_error(capsys) -> None:
    assert main(["serve", "models/a", "-m", "models/b"]) == 2
    err = capsys.readouterr().err
    assert "models/a" in err and "models/b" in err and "once" in err


def test_help_names_the_positional_model(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "-h"])
    out = capsys.readouterr().out
    assert out.startswith("usage: qasr serve [MODEL]") and "vllm serve MODEL" in " ".join(out.split())
