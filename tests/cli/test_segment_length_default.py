"""A checkpoint folder declares its segment length (config.json ``"qasr": {"max_segment_s": S}``): the API,
the CLI, the server's ``prepare`` and the Ray driver take it when the call names none; an explicit value
overrides it; a folder without it keeps 30 s; a malformed one is refused when the model loads."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest

from qasr import ASR, TranscribeOptions
from qasr.cli.main import build_parser, main
from qasr.model.config import DEFAULT_MAX_SEGMENT_S, ModelConfig
from qasr.model.weights import resolve_model_dir
from qasr.testing import make_tiny_checkpoint

SR = 16000
DEMO = Path(__file__).resolve().parents[2] / "models" / "qasr-demo-en"
PREFERRED = 4.0


def _declare(folder: Path, value: object) -> Path:
    config = folder / "config.json"
    data = json.loads(config.read_text())
    data["qasr"] = value
    config.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def preferring(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose config.json declares segments of at most 4 s."""
    path = Path(make_tiny_checkpoint(tmp_path_factory.mktemp("preferring"), layout="original", seed=0))
    return _declare(path, {"max_segment_s": PREFERRED})


@pytest.fixture(scope="module")
def asr(preferring: Path):  # noqa: ANN201
    model = ASR.from_pretrained(preferring, device="cpu", dtype="float32")
    yield model
    model.close()


def _wave(seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (0.1 * rng.standard_normal(int(seconds * SR))).astype(np.float32)


def test_a_declared_length_is_the_default(asr) -> None:
    assert asr.max_segment_s == PREFERRED and asr._core.checkpoint.config.declared_max_segment_s == PREFERRED
    [r] = asr.transcribe((_wave(18.0), SR), TranscribeOptions(segmentation="fixed"), max_new_tokens=2)
    assert r.ok, r.error
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 4.0), (4.0, 8.0), (8.0, 12.0), (12.0, 16.0),
                                                        (16.0, 18.0)]
    # auto: an input longer than the model's length is segmented, one within it goes whole
    assert len(asr._core.prepare((_wave(3.5), SR), TranscribeOptions(max_new_tokens=2))) == 1
    # the server's way in (prepare, no length given) and the other entry points agree
    pieces = asr._core.prepare((_wave(18.0), SR), TranscribeOptions(segmentation="fixed", max_new_tokens=2))
    assert [p.duration for p in pieces] == [4.0, 4.0, 4.0, 4.0, 2.0]
    segs = list(asr.transcribe_segments((_wave(18.0), SR), TranscribeOptions(segmentation="fixed"), max_new_tokens=2))
    assert [s.end - s.start for s in segs] == [4.0, 4.0, 4.0, 4.0, 2.0]


def test_an_explicit_length_overrides_the_model(asr) -> None:
    [r] = asr.transcribe((_wave(18.0), SR), TranscribeOptions(segmentation="fixed", max_segment_s=10.0),
                         max_new_tokens=2)
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 10.0), (10.0, 18.0)]
    with pytest.raises(ValueError, match="max_segment_s must be positive"):
        asr.transcribe((_wave(2.0), SR), TranscribeOptions(max_segment_s=0))


def test_a_folder_without_the_key_keeps_30_s(tiny_asr) -> None:
    assert tiny_asr._core.checkpoint.config.declared_max_segment_s is None
    assert tiny_asr.max_segment_s == DEFAULT_MAX_SEGMENT_S == 30.0
    [r] = tiny_asr.transcribe((_wave(45.0), SR), TranscribeOptions(segmentation="fixed"), max_new_tokens=2)
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 30.0), (30.0, 45.0)]


def _segments_in_json(out: Path) -> list[list[float]]:
    data = json.loads(next(out.glob("*.json")).read_text())
    return [[s["start"], s["end"]] for s in data["segments"]]


def test_the_cli_default_follows_the_model(preferring, tmp_path, capsys) -> None:
    assert build_parser().parse_args(["transcribe", "x.wav"]).max_segment_s is None
    import soundfile as sf

    wav = tmp_path / "noise.wav"
    sf.write(wav, _wave(10.0), SR)
    common = ["transcribe", str(wav), "-m", str(preferring), "--device", "cpu", "--dtype", "float32",
              "--segmentation", "fixed", "--max-new-tokens", "2", "-f", "json"]
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own: give pytest's back afterwards
    try:
        assert main([*common, "-o", str(tmp_path / "model")]) == 0
        assert _segments_in_json(tmp_path / "model") == [[0.0, 4.0], [4.0, 8.0], [8.0, 10.0]]
        assert main([*common, "-o", str(tmp_path / "given"), "--max-segment-s", "6"]) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert _segments_in_json(tmp_path / "given") == [[0.0, 6.0], [6.0, 10.0]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["transcribe", "--help"])
    assert "max_segment_s" in " ".join(capsys.readouterr().out.split())  # --help says where the default comes from


def test_the_ray_driver_reads_the_same_default(preferring, tiny_original) -> None:
    from qasr.distributed.config import EngineSpec, PoolConfig
    from qasr.distributed.ray_data import RayTranscriber

    pool = PoolConfig(min_actors=1, max_actors=1, actor_cpus=1.0, actor_gpus=0.0)
    declared = RayTranscriber(EngineSpec(str(preferring)), pool)
    assert declared._options(TranscribeOptions()).max_segment_s == PREFERRED
    assert declared._options(TranscribeOptions(max_segment_s=9.0)).max_segment_s == 9.0
    assert RayTranscriber(EngineSpec(str(tiny_original)), pool)._options(TranscribeOptions()).max_segment_s == 30.0
    unreadable = RayTranscriber(EngineSpec(str(tiny_original / "missing")), pool)
    assert unreadable._options(TranscribeOptions()).max_segment_s == 30.0  # the actors will refuse the model


def test_the_ray_driver_checks_the_language_against_the_models_own(tiny_original) -> None:
    from qasr.distributed.config import EngineSpec, PoolConfig
    from qasr.distributed.ray_data import RayTranscriber

    pool = PoolConfig(min_actors=1, max_actors=1, actor_cpus=1.0, actor_gpus=0.0)
    demo = RayTranscriber(EngineSpec(str(DEMO)), pool)
    assert demo.check_language("en") == "English"
    with pytest.raises(ValueError, match="supported: English"):
        demo.check_language("fr")


@pytest.mark.parametrize("value", [{"max_segment_s": "eight"}, {"max_segment_s": 0}, {"max_segment_s": -5},
                                   {"max_segment_s": math.inf}, {"max_segment_s": True}, 12, "fast"])
def test_a_malformed_value_is_refused(value: object) -> None:
    data = json.loads((DEMO / "config.json").read_text())
    data["qasr"] = value
    with pytest.raises(ValueError, match=r'"qasr"'):
        ModelConfig.from_dict(data)


def test_a_malformed_value_fails_at_load_naming_the_file(tmp_path) -> None:
    path = _declare(Path(make_tiny_checkpoint(tmp_path / "bad", layout="hf", seed=0)), {"max_segment_s": "long"})
    config = resolve_model_dir(path) / "config.json"
    with pytest.raises(ValueError, match="must be a positive number of seconds, got 'long'") as caught:
        ASR.from_pretrained(path, device="cpu", dtype="float32")
    assert str(config) in str(caught.value)
    # null or an object without the key is "not declared"
    _declare(path, {"max_segment_s": None, "something_later": 1})
    assert ModelConfig.from_file(config).max_segment_s == 30.0


def test_the_bundled_demo_model_declares_its_measured_length() -> None:
    assert ModelConfig.from_file(DEMO / "config.json").max_segment_s == 6.0  # docs/segmentation.md
