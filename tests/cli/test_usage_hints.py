"""What a user coming from whisper or faster-whisper meets first: an unknown flag answered with the subcommand's
usage and the flag meant, the model's own languages in a language error, an unused --aligner not loaded."""

from __future__ import annotations

import pytest
from server_proc import ALARM, DEMO_ARGS, run_qasr

from qasr.cli.main import build_parser


def error_of(argv: list[str], capsys) -> tuple[str, str]:
    """The usage line and the error line argparse prints for ``argv``."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    return err.splitlines()[0], err.splitlines()[-1]


def test_an_unknown_flag_prints_the_subcommands_usage_and_the_flag_meant() -> None:
    out = run_qasr("transcribe", ALARM, "--output_format", "srt")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("usage: qasr transcribe ")
    assert out.stderr.splitlines()[-1] == ("qasr transcribe: error: unrecognized arguments: --output_format srt; "
                                           "--output_format: did you mean -f/--format?")


@pytest.mark.parametrize(("flag", "meant"), [
    ("--output_format", "-f/--format"),
    ("--output_dir", "-o/--output-dir"),
    ("--word_timestamps", "--timestamps word"),
    ("--compute_type", "--dtype or --quantize"),
    ("--model_size", "-m/--model"),
    ("--initial_prompt", "--context"),
    ("--vad_filter", "--segmentation vad"),
    ("--max_segment_s", "--max-segment-s"),  # an underscore for a dash
    ("--vad_threshold=0.3", "--vad-threshold"),
    ("--langauge", "--language"),  # a typo
])
def test_other_tools_spellings_are_mapped_to_qasrs_flags(flag: str, meant: str, capsys) -> None:
    usage, error = error_of(["transcribe", "x.wav", flag], capsys)
    assert usage.startswith("usage: qasr transcribe ")
    assert error.endswith(f"{flag}: did you mean {meant}?"), error


def test_an_unknown_flag_without_a_close_one_gets_no_hint(capsys) -> None:
    assert error_of(["transcribe", "x.wav", "--bogus"], capsys)[1] == (
        "qasr transcribe: error: unrecognized arguments: --bogus")
    usage, error = error_of(["kernels", "build", "--bogus"], capsys)
    assert usage.startswith("usage: qasr kernels build") and error.endswith("unrecognized arguments: --bogus")


@pytest.mark.parametrize(("language", "message"), [
    ("Englsh", "language 'Englsh' is not supported by this model (did you mean English?); supported: English"),
    ("fr", "language 'fr' is not supported by this model; supported: English"),
    ("French", "language 'French' is not supported by this model; supported: English"),
])
def test_a_language_error_lists_the_models_own_languages(language: str, message: str) -> None:
    out = run_qasr("transcribe", ALARM, *DEMO_ARGS, "--language", language)
    assert out.returncode == 2 and out.stderr == f"qasr: error: {message}\n"


@pytest.mark.slow
def test_an_aligner_without_word_timestamps_is_not_loaded() -> None:
    out = run_qasr("transcribe", ALARM, *DEMO_ARGS, "--aligner", "/no/such/aligner")  # loading it would exit 2
    assert out.returncode == 0, out.stderr
    assert out.stderr == "qasr: warning: --aligner is used only with --timestamps word; not loading it\n"
    assert out.stdout == "set an alarm for seven thirty tomorrow\n"
