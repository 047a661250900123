"""Writers: each format parsed back with a real parser and checked against the cue rules and the text."""

from __future__ import annotations

import csv
import html
import io
import json
import os
import stat

import pytest
import srt
import webvtt
from test_subtitles import assert_follows_rules, words_text

from qasr.outputs.subtitles import CueRules
from qasr.outputs.writers import FORMATS, output_path, render, write_atomic
from qasr.results import Segment, Transcription, Word

WORDS = tuple(Word(w, 3600.0 + 0.4 * i, 3600.0 + 0.4 * i + 0.3) for i, w in enumerate(words_text(50, 2).split()))
SEGMENTS = (
    Segment(3590.0, 3600.0, words_text(70, 1) + " & <tags> --> stay text"),  # untimed, crosses the hour
    Segment(3600.0, 3620.0, " ".join(w.text for w in WORDS), words=WORDS, finish_reason="length"),
    Segment(3620.0, 3621.0, ""),
    Segment(3621.0, 3650.0, "x" * 60 + " then a tab\there and a newline\nthere"),
)
RESULT = Transcription(text=" ".join(s.text for s in SEGMENTS), language="English", duration=3650.0,
                       segments=SEGMENTS, source="talk.wav", finish_reason="length")


def _seconds(stamp: str) -> float:
    h, m, s = stamp.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def parse_srt(text: str) -> list[tuple[float, float, list[str]]]:
    subs = list(srt.parse(text))
    assert [s.index for s in subs] == list(range(1, len(subs) + 1))
    return [(s.start.total_seconds(), s.end.total_seconds(), s.content.split("\n")) for s in subs]


def parse_vtt(text: str) -> list[tuple[float, float, list[str]]]:
    assert text.startswith("WEBVTT\n\n")
    # webvtt-py leaves entities as written; a browser would unescape them
    return [(_seconds(c.start), _seconds(c.end), [html.unescape(line) for line in c.lines])
            for c in webvtt.from_string(text)]


def parse_tsv(text: str) -> list[tuple[float, float, list[str]]]:
    rows = list(csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE))
    assert rows[0] == ["start", "end", "text"] and all(len(r) == 3 for r in rows)
    return [(int(a) / 1000, int(b) / 1000, [t]) for a, b, t in rows[1:]]


PARSERS = {"srt": parse_srt, "vtt": parse_vtt}


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_parse_back_and_follow_the_rules(fmt: str) -> None:
    got = PARSERS[fmt](render(RESULT, fmt))
    assert_follows_rules(got, list(SEGMENTS))
    # the hour shows in the timestamps, and the word-timed cues start at word starts
    assert got[0][0] == 3590.0 and got[-1][1] == 3650.0
    word_cues = [c for c in got if 3600.0 <= c[0] < 3620.0]
    assert word_cues and all(round(c[0], 3) in {round(w.start, 3) for w in WORDS} for c in word_cues)


def test_tsv_parses_back_one_row_per_cue() -> None:
    text = render(RESULT, "tsv")
    got = parse_tsv(text)
    # a row is a cue on one line: the srt cue's lines joined by spaces, tabs and newlines gone
    assert got == [(a, b, [" ".join(lines)]) for a, b, lines in parse_srt(render(RESULT, "srt"))]
    assert_follows_rules(got, list(SEGMENTS), rules=CueRules(max_line_chars=10**6, max_lines=1))
    assert text.splitlines()[1].startswith("3590000\t")


def test_json_fields_and_compact_form() -> None:
    text = render(RESULT, "json")
    data = json.loads(text)
    assert list(data) == ["text", "language", "duration", "finish_reason", "source", "error", "timestamps",
                          "segments"]
    assert (data["language"], data["duration"], data["finish_reason"], data["source"], data["error"]) == (
        "English", 3650.0, "length", "talk.wav", None)
    assert [s["text"] for s in data["segments"]] == [s.text for s in SEGMENTS]
    assert [s["finish_reason"] for s in data["segments"]] == ["stop", "length", "stop", "stop"]
    assert "words" not in data["segments"][0]
    assert data["segments"][1]["words"][0] == {"text": WORDS[0].text, "start": 3600.0, "end": 3600.3,
                                               "probability": None}  # no token log-probabilities behind these
    compact = render(RESULT, "json", compact=True)
    assert compact.count("\n") == 1 and compact.endswith("\n") and json.loads(compact) == data


def test_txt_and_an_unknown_format() -> None:
    assert render(RESULT, "txt") == RESULT.text + "\n"
    with pytest.raises(ValueError, match="srt"):
        render(RESULT, "docx")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_input_renders_to_an_empty_valid_file(fmt: str) -> None:
    failed = Transcription(text="", language="", duration=0.0, error="nope.wav: not found", source="nope.wav")
    text = render(failed, fmt)
    if fmt in PARSERS:
        assert PARSERS[fmt](text) == []
    elif fmt == "tsv":
        assert parse_tsv(text) == []
    elif fmt == "json":
        assert json.loads(text)["error"] == "nope.wav: not found"


def test_write_atomic_gives_umask_permissions(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "out" / "talk.srt"
        write_atomic(path, render(RESULT, "srt"))
        write_atomic(path, "second\n")  # over an existing file
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_text() == "second\n" and os.listdir(path.parent) == ["talk.srt"]


def test_write_atomic_leaves_no_temp_file_when_it_fails(tmp_path) -> None:
    path = tmp_path / "talk.txt"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "half \ud800 written")  # a lone surrogate cannot be encoded
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "dir.txt", "text\n")  # the rename fails
    assert sorted(os.listdir(tmp_path)) == ["dir.txt", "talk.txt"] and path.read_text() == "old\n"
    assert os.listdir(tmp_path / "dir.txt") == []


def test_write_atomic_leaves_no_temp_file_when_interrupted_right_after_creating_it(tmp_path, monkeypatch) -> None:
    """Ctrl-C may land just after os.open returned, before the file object exists: the temp file goes too."""
    real_open = os.open

    def open_then_interrupt(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        real_open(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "talk.txt", "text\n")
    assert os.listdir(tmp_path) == []


def test_output_path(tmp_path) -> None:
    assert output_path(tmp_path, "/data/talk.wav", "vtt") == tmp_path / "talk.vtt"
