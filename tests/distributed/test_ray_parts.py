"""The parts of ``qasr.distributed`` that need no Ray runtime (they run in ``make test``): joining an input from
its segments' own results, exactly as ``Core.assemble`` joins them, the driver's regrouping of segment rows
that arrive in any order and sometimes twice, and the naming of URI inputs' outputs.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import noise

from qasr import TranscribeOptions
from qasr.distributed import rows
from qasr.distributed.assemble import Collector, merge_parts
from qasr.engine.request import GenerationResult
from qasr.results import Transcription, Word
from qasr.transcribe.words import Aligned


@pytest.fixture(scope="module")
def pieces(tiny_asr):
    got = tiny_asr._core.prepare((noise(70.0, seed=3), 16000),
                                 TranscribeOptions(segmentation="fixed", max_segment_s=20.0))
    assert [round(p.offset) for p in got] == [0, 20, 40, 60]
    return got


def _outcomes(tiny_asr) -> list[GenerationResult]:
    tok = tiny_asr._core.checkpoint.tokenizer
    return [GenerationResult(tok.encode("language English<asr_text>one two"), "stop", 0.0, 0.0),
            GenerationResult(tok.encode("langu"), "stop", 0.0, 0.0),  # no tag: malformed, no text
            GenerationResult(tok.encode("language Chinese<asr_text>你好"), "length", 0.0, 0.0),
            GenerationResult(tok.encode("language English<asr_text>three"), "stop", 0.0, 0.0)]


def _merged(tiny_asr, pieces, outcomes, words: bool) -> tuple[Transcription, Transcription]:
    whole = tiny_asr._core.assemble(pieces, outcomes)
    parts = [tiny_asr._core.assemble([p], [o]) for p, o in zip(pieces, outcomes, strict=True)]
    end = max(p.offset + p.duration for p in pieces)
    return merge_parts(parts, source=whole.source, duration=end, words=words), whole


def test_segment_results_join_as_assemble_joins_them(tiny_asr, pieces) -> None:
    outcomes = _outcomes(tiny_asr)
    merged, whole = _merged(tiny_asr, pieces, outcomes, words=False)
    assert merged == whole
    assert whole.text == "one two你好three" and whole.finish_reason == "malformed"
    assert whole.language == "English,Chinese,English"

    timed = [Aligned(o, words=(Word("x", p.offset, p.offset + 1.0),)) for p, o in zip(pieces, outcomes, strict=True)]
    merged, whole = _merged(tiny_asr, pieces, timed, words=True)
    assert merged == whole and whole.timestamps == "word" and whole.segments[0].words
    timed[3] = Aligned(outcomes[3], words=(), note="no words")  # a segment with text and no words: none keep theirs
    merged, whole = _merged(tiny_asr, pieces, timed, words=True)
    assert merged == whole and whole.timestamps == "segment" and not any(s.words for s in whole.segments)

    failed = list(outcomes)
    failed[2] = ValueError("boom")
    merged, whole = _merged(tiny_asr, pieces, failed, words=False)
    assert merged == whole and whole.error == "array input: boom"


def test_the_driver_takes_segments_in_any_order_and_once(tiny_asr, pieces) -> None:
    outcomes = _outcomes(tiny_asr)
    parts = [tiny_asr._core.assemble([p], [o]) for p, o in zip(pieces, outcomes, strict=True)]
    seconds: list[float] = []
    collector = Collector(["long.wav", "bad.mp3", "short.wav"], words=False, progress=seconds.append)
    part_rows = [rows.row(0, "long.wav", rows.PART, k=k, offset=p.offset, duration=p.duration,
                          part=pickle.dumps(part)) for k, (p, part) in enumerate(zip(pieces, parts, strict=True))]
    end = rows.row(0, "long.wav", rows.END, count=4, duration=71.5)  # the input ends in silence past its pieces
    arrivals = [part_rows[2], end, part_rows[0],
                rows.row(1, "bad.mp3", rows.END, error="bad.mp3: cannot be decoded"),
                part_rows[0],  # again: a retried call repeated it
                rows.row(2, "short.wav", rows.FAILED, k=0, error="short.wav: audio too short"),
                part_rows[3]]
    assert [collector.add(r) for r in arrivals[:3]] == [None, None, None]
    i, bad = collector.add(arrivals[3])
    assert i == 1 and bad == Transcription("", "", 0.0, error="bad.mp3: cannot be decoded", source="bad.mp3")
    assert collector.add(arrivals[4]) is None and collector.repeats == 1
    i, short = collector.add(arrivals[5])
    assert i == 2 and short.error == "short.wav: audio too short" and short.duration == 0.0
    assert collector.add(arrivals[6]) is None
    assert collector.incomplete() == {0: {0, 2, 3}}  # a further pass would transcribe segment 1 alone
    i, long = collector.add(part_rows[1])
    assert i == 0 and long == merge_parts(parts, source="long.wav", duration=71.5, words=False)
    assert long.duration == 71.5 and long.text == "one two你好three"
    assert collector.incomplete() == {} and collector.segments == 5
    assert sorted(seconds) == pytest.approx(sorted(p.duration for p in pieces))  # once per distinct segment


def test_uri_inputs_are_listed_and_placed_like_local_folders(tmp_path) -> None:
    pytest.importorskip("pyarrow")  # comes with the ray extra
    from qasr.distributed.inputs import find_inputs, plan_jobs

    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ("b.wav", "a.mp3", "notes.txt", "sub/c.flac", "sub/a.wav"):
        (tmp_path / "in" / name).write_bytes(b"x")
    folder = f"file://{tmp_path / 'in'}"
    assert find_inputs([folder]) == [f"{folder}/a.mp3", f"{folder}/b.wav"]
    found = find_inputs([folder, f"{folder}/b.wav"], recursive=True)  # sorted, media only, duplicates once
    assert found == [f"{folder}/a.mp3", f"{folder}/b.wav", f"{folder}/sub/a.wav", f"{folder}/sub/c.flac"]
    out = Path("/out")
    assert [j.base for j in plan_jobs(found, out)] == [out / "a", out / "b", out / "sub" / "a", out / "sub" / "c"]
    assert [j.source for j in plan_jobs(found, out)] == found
    jobs = plan_jobs(["s3://bucket/talks/day1/x.mp3", "s3://bucket/talks/day2/x.mp3", "gs://other/x.wav"], out)
    assert [j.base for j in jobs] == [out / "s3/bucket/talks/day1/x", out / "s3/bucket/talks/day2/x",
                                      out / "gs/other/x"]
