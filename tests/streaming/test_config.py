"""The live-session settings are declared once (streaming/config.py): each has its help text, the ones a
/v1/stream start message may set are marked there with the ranges a server takes, and from_start checks
their JSON types and ranges."""

from dataclasses import fields

import pytest

from qasr.streaming.config import SERVED_RANGES, START_SETTINGS, LiveConfig, StreamConfig, check_served, from_start


def test_every_setting_has_its_help() -> None:
    for cls in (StreamConfig, LiveConfig):
        for f in fields(cls):
            assert f.name == "stream" or f.metadata["help"], f.name


def test_the_start_message_sets_these() -> None:
    assert set(START_SETTINGS) == {"chunk_size_sec", "context", "language", "turn_detection", "vad_threshold",
                                   "silence_ms", "prefix_padding_ms", "max_turn_s", "soft_turn_s", "carry_context",
                                   "end_on_chunk"}


def test_from_start_fills_both_configs_by_name() -> None:
    base = LiveConfig(StreamConfig(chunk_size_sec=1.0), end_on_chunk=False)
    got = from_start({"language": "English", "context": None, "silence_ms": 800, "vad_threshold": 1 / 4,
                      "max_turn_s": 20}, base)
    assert got.stream == StreamConfig(chunk_size_sec=1.0, language="English")
    assert (got.silence_ms, got.vad_threshold, got.max_turn_s, got.soft_turn_s) == (800, 0.25, 20.0, 20.0)
    assert type(got.max_turn_s) is float and got.end_on_chunk is False  # the base's, untouched
    assert from_start({}, base) == base


@pytest.mark.parametrize(("settings", "match"), [
    ({"max_new_tokens": 4}, "unknown settings"),
    ({"turn_detection": 1}, "turn_detection must be a bool"),
    ({"silence_ms": "500"}, "silence_ms must be a int"),
    ({"chunk_size_sec": "1.5"}, "chunk_size_sec must be a float"),
    ({"context": 5}, "context must be a str"),
    ({"vad_threshold": 1.5}, "vad_threshold must be in"),
    ({"soft_turn_s": 90.0}, "soft_turn_s"),
    ({"chunk_size_sec": 0.01}, r"chunk_size_sec must be from 0.25 to 30, got 0.01"),
    ({"chunk_size_sec": 31}, r"chunk_size_sec must be from 0.25 to 30"),
    ({"max_turn_s": 1e6}, r"max_turn_s must be from 1 to 120, got 1e\+06"),
    ({"silence_ms": 10001}, r"silence_ms must be from 0 to 10000"),
    ({"prefix_padding_ms": -1}, r"prefix_padding_ms must be from 0 to 10000"),
])
def test_from_start_refuses_what_the_configs_would_not_take(settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_start(settings)


def test_qasr_stream_sends_only_settings_declared_here() -> None:
    from qasr.cli.stream_client import _NativeWire

    sent = _NativeWire(None, "English", False).settings
    assert set(sent) - {"type", "sample_rate", "format"} <= set(START_SETTINGS)
    assert from_start({k: sent[k] for k in sent if k in START_SETTINGS}).turn_detection is False


def test_the_served_ranges_hold_the_defaults_and_bound_what_a_client_could_blow_up() -> None:
    assert set(SERVED_RANGES) == {"chunk_size_sec", "silence_ms", "prefix_padding_ms", "max_turn_s"}
    assert set(SERVED_RANGES) <= set(START_SETTINGS)
    for name, (low, high) in SERVED_RANGES.items():
        default = getattr(StreamConfig if name == "chunk_size_sec" else LiveConfig, name)
        assert low <= default <= high, name
    assert from_start({"chunk_size_sec": 0.25, "max_turn_s": 120, "silence_ms": 0}).max_turn_s == 120.0
    with pytest.raises(ValueError, match="live_chunk_s must be from 0.25 to 30, got 0.1"):
        check_served("chunk_size_sec", 0.1, "live_chunk_s")


def test_engine_timeout_s_is_checked_and_no_client_sets_it() -> None:
    assert StreamConfig().engine_timeout_s is None and StreamConfig(engine_timeout_s=2).engine_timeout_s == 2
    with pytest.raises(ValueError, match="engine_timeout_s must be > 0"):
        StreamConfig(engine_timeout_s=0)
    with pytest.raises(ValueError, match="unknown settings"):
        from_start({"engine_timeout_s": 1.0})
