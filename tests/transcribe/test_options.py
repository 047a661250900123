"""TranscribeOptions: checked once, when made, with errors naming the option; the CLI's flags and the server's
form fields are made from it."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
from starlette.datastructures import FormData, UploadFile

from qasr import TranscribeOptions, VadConfig
from qasr.cli.main import build_parser
from qasr.transcribe.options import from_flags, model_language


@pytest.mark.parametrize(("given", "message"), [
    ({"segmentation": "chunks"}, "segmentation must be one of auto, vad, fixed, none, got 'chunks'"),
    ({"timestamps": "char"}, "timestamps must be one of segment, word, got 'char'"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"max_segment_s": 0}, "max_segment_s must be positive, got 0"),
    ({"max_segment_s": -3.0}, "max_segment_s must be positive"),
    ({"sample_rate": 0}, "sample_rate must be >= 1"),
    ({"language": "Klingon"}, "unsupported language 'Klingon'"),
    ({"language": ["en", "Klingon"]}, "unsupported language 'Klingon'"),
])
def test_a_bad_option_is_refused_when_made(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TranscribeOptions(**given)


def test_lists_become_tuples_and_shortcuts_replace_fields() -> None:
    o = TranscribeOptions(language=["en", None], context=["a", "b"], segmentation="vad")
    assert o.language == ("en", None) and o.context == ("a", "b")
    hash(o)  # frozen and hashable
    assert o.given(language=None, timestamps=None) is o  # None: the options' own
    g = o.given(language="fr", max_new_tokens=5)
    assert (g.language, g.max_new_tokens, g.segmentation) == ("fr", 5, "vad")
    with pytest.raises(ValueError, match="max_new_tokens"):
        o.given(max_new_tokens=0)  # a shortcut is checked like the field
    model = SimpleNamespace(max_segment_s=12)
    assert o.for_model(model).max_segment_s == 12.0
    assert TranscribeOptions(max_segment_s=4).for_model(model).max_segment_s == 4


def test_every_field_has_its_help() -> None:
    for f in fields(TranscribeOptions):
        assert f.metadata["help"].strip(), f.name


def test_the_transcribe_flags_come_from_the_options() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["transcribe"]
    flags = {a.dest: a for a in sub._actions}
    for f in fields(TranscribeOptions):
        if f.metadata["flag"] is None:
            assert f.name not in flags
            continue
        action = flags[f.name]
        assert action.help == f.metadata["help"] and action.default == f.default
    assert tuple(flags["segmentation"].choices) == ("auto", "vad", "fixed", "none")
    args = parser.parse_args(["transcribe", "x.wav", "--language", "en", "--context", "Kubernetes",
                              "--segmentation", "fixed", "--max-segment-s", "12.5", "--max-new-tokens", "40",
                              "--timestamps", "word", "--vad-backend", "energy", "--vad-threshold", "0.3"])
    assert from_flags(args) == TranscribeOptions(language="en", context="Kubernetes", segmentation="fixed",
                                                 max_segment_s=12.5, max_new_tokens=40, timestamps="word",
                                                 vad=VadConfig(backend="energy", threshold=0.3))
    assert from_flags(parser.parse_args(["transcribe", "x.wav"])) == TranscribeOptions()


@pytest.mark.parametrize("argv", [["--max-segment-s", "0"], ["--max-new-tokens", "0"], ["--segmentation", "x"]])
def test_a_bad_flag_is_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["transcribe", "x.wav", *argv])
    assert info.value.code == 2


def test_an_unknown_language_fails_before_the_model_loads(tmp_path, capsys) -> None:
    from qasr.cli.main import main

    (tmp_path / "a.wav").write_bytes(b"")
    assert main(["transcribe", str(tmp_path / "a.wav"), "-m", str(tmp_path / "no-model"), "--language", "xx"]) == 2
    assert "language 'xx' is not supported by this model; supported: Chinese, English" in capsys.readouterr().err


@pytest.mark.parametrize(("lang", "supported", "message"), [
    ("Englsh", ("English",), "language 'Englsh' is not supported by this model (did you mean English?); "
                             "supported: English"),
    ("eng", ("English", "German"), "(did you mean English?); supported: English, German"),
    ("germn", ("English", "German"), "(did you mean German?)"),
    ("fr", ("English",), "language 'fr' is not supported by this model; supported: English"),
    ("French", ("English",), "language 'French' is not supported by this model; supported: English"),
    ("Klingon", ("English",), "language 'Klingon' is not supported by this model; supported: English"),
])
def test_a_language_error_lists_the_models_languages_and_the_closest(lang: str, supported: tuple,
                                                                     message: str) -> None:
    with pytest.raises(ValueError) as info:
        model_language(lang, supported)
    assert message in str(info.value)


def test_a_language_the_model_lists_is_its_canonical_name() -> None:
    assert model_language("EN", ("English",)) == "English" and model_language("yue", ("Cantonese",)) == "Cantonese"
    assert model_language(None, ("English",)) is None and model_language(" ", ()) is None


def test_the_server_form_becomes_options() -> None:
    from qasr.server.params import parse_params

    core = SimpleNamespace(aligner=SimpleNamespace(supported_languages=("English",)),
                           canonical_language=lambda lang: {"en": "English"}.get(lang, lang))
    form = FormData([("file", UploadFile(file=None, filename="a.wav")), ("language", "en"),  # type: ignore[arg-type]
                     ("prompt", "Kubernetes"), ("response_format", "verbose_json"),
                     ("timestamp_granularities[]", "word"), ("chunking_strategy", '{"type": "server_vad", '
                                                                                   '"threshold": 0.4}')])
    p = parse_params(form, core)  # type: ignore[arg-type]
    assert p.options == TranscribeOptions(language="English", context="Kubernetes", segmentation="vad",
                                          vad=VadConfig(threshold=0.4), timestamps="word")
    assert p.words
    plain = parse_params(FormData([("file", UploadFile(file=None, filename="a.wav"))]), core)  # type: ignore[arg-type]
    assert plain.options == TranscribeOptions() and not plain.words
