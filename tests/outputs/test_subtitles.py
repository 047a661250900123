"""Cue rules (qasr.outputs.subtitles): line length and count, duration, order, no overlap, and no text lost."""

from __future__ import annotations

import random

from qasr.outputs.subtitles import CueRules, cues
from qasr.results import Segment, Word

RULES = CueRules()
EPS = 1e-3  # writers keep milliseconds: parsed-back times may be off by rounding


def assert_follows_rules(got: list[tuple[float, float, list[str]]], segments: list[Segment],
                         rules: CueRules = RULES, sep: str = " ") -> None:
    """``got``: (start, end, lines) per cue, from cues() or parsed back from a writer's output.

    ``sep`` is what the text has between cues and lines: a space, or nothing for CJK (then the
    text is compared with all whitespace removed).
    """
    words = {w for seg in segments for w in seg.text.split()}
    prev_end = 0.0
    for start, end, lines in got:
        assert 1 <= len(lines) <= rules.max_lines, lines
        for line in lines:
            assert line == line.strip() and line
            # the one allowed overflow: a single word too long for any line
            assert len(line) <= rules.max_line_chars or line in words, line
        assert start >= prev_end - EPS, "cues overlap or are out of order"
        assert start <= end <= start + rules.max_cue_s + EPS
        prev_end = end
    shown = sep.join(sep.join(lines) for _, _, lines in got)
    spoken = sep.join(sep.join(seg.text.split()) for seg in segments if seg.text.strip())
    if not sep:
        shown, spoken = "".join(shown.split()), "".join(spoken.split())
    assert shown == spoken


def as_tuples(cs) -> list[tuple[float, float, list[str]]]:
    return [(c.start, c.end, list(c.lines)) for c in cs]


def words_text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices("abcdefghij", k=rng.randint(1, 11))) for _ in range(n))


def test_short_segment_is_one_cue_of_one_line() -> None:
    seg = Segment(1.0, 2.5, "hello  there\n world")
    (cue,) = cues([seg])
    assert (cue.start, cue.end, cue.lines, cue.text) == (1.0, 2.5, ("hello there world",), "hello there world")


def test_empty_segments_give_no_cues() -> None:
    assert cues([Segment(0.0, 1.0, ""), Segment(1.0, 2.0, "  \n")]) == []
    assert cues([Segment(0.0, 1.0, "", words=(Word(" ", 0.0, 1.0),))]) == []


def test_two_lines_are_balanced() -> None:
    seg = Segment(0.0, 3.0, "the quick brown fox jumps over the lazy dog and runs far away")  # 62 chars
    (cue,) = cues([seg])
    assert len(cue.lines) == 2 and abs(len(cue.lines[0]) - len(cue.lines[1])) <= 6, cue.lines


def test_long_untimed_segment_is_split_in_proportion_to_characters() -> None:
    text = words_text(80)
    seg = Segment(0.0, 30.0, text)
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg])
    assert len(cs) > 4
    # contiguous: the cues cover the segment's span with no gaps
    assert cs[0].start == 0.0 and abs(cs[-1].end - 30.0) < 1e-9
    assert all(abs(a.end - b.start) < 1e-9 for a, b in zip(cs, cs[1:], strict=False))
    letters = len(text.replace(" ", ""))
    for c in cs:
        assert abs((c.end - c.start) - 30.0 * len(c.text.replace(" ", "")) / letters) < 1e-9
    # even cues: no one-word orphan at the end
    sizes = [len(c.text) for c in cs]
    assert min(sizes) > max(sizes) / 2, sizes


def test_duration_limit_splits_a_slow_untimed_segment() -> None:
    seg = Segment(10.0, 40.0, "one two three four five six")  # 30 s for 27 characters
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg])
    assert len(cs) >= 5


def test_word_times_set_the_breaks() -> None:
    rng = random.Random(1)
    words, t = [], 5.0
    for w in words_text(60, seed=1).split():
        dur = rng.uniform(0.1, 0.6)
        words.append(Word(w, round(t, 3), round(t + dur, 3)))
        t += dur + rng.choice([0.0, 0.05, 0.8])
    seg = Segment(5.0, t, " ".join(w.text for w in words), words=tuple(words))
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg])
    # each cue runs from its first word's start to its last word's end
    i = 0
    for c in cs:
        n = len(c.text.split())
        assert c.text == " ".join(w.text for w in words[i:i + n])
        assert (c.start, c.end) == (words[i].start, words[i + n - 1].end)
        i += n
    assert i == len(words)


def test_word_times_and_the_duration_limit() -> None:
    words = tuple(Word(f"w{i}", 2.0 * i, 2.0 * i + 1.5) for i in range(10))  # 2 s a word
    seg = Segment(0.0, 20.0, " ".join(w.text for w in words), words=words)
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg])
    # four words would span 7.5 s: three at most, so four cues for ten words
    assert len(cs) == 4 and all(len(c.text.split()) <= 3 for c in cs)
    assert all(c.start in {w.start for w in words} and c.end in {w.end for w in words} for c in cs)


def test_a_word_longer_than_the_cue_limit_is_clipped() -> None:
    seg = Segment(0.0, 12.0, "hmm", words=(Word("hmm", 1.0, 11.0),))
    (cue,) = cues([seg])
    assert (cue.start, cue.end) == (1.0, 8.0)


def test_cjk_is_broken_by_characters() -> None:
    text = "今天天气很好，我们去公园散步吧。明天可能会下雨，所以要带伞。" * 3
    seg = Segment(0.0, 12.0, text)
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg], sep="")
    assert len(cs) >= 2 and all(" " not in c.text for c in cs)
    # closing punctuation stays with the character before it
    assert not any(line[0] in "，。" for c in cs for line in c.lines)


def test_cjk_words_with_times_are_joined_without_spaces() -> None:
    chars = "我们今天去公园散步" * 6
    words = tuple(Word(ch, 0.2 * i, 0.2 * i + 0.15) for i, ch in enumerate(chars))
    cs = cues([Segment(0.0, 11.0, chars, words=words)])
    assert_follows_rules(as_tuples(cs), [Segment(0.0, 11.0, chars)], sep="")


def test_mixed_script_keeps_latin_words_whole() -> None:
    seg = Segment(0.0, 9.0, "我们用 Python 写代码" + "，然后测试它" * 10)
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg], sep="")
    assert "Python" in cs[0].text and " Python " in cs[0].text


def test_a_word_longer_than_a_line_is_the_only_overflow() -> None:
    url = "https://example.com/" + "a" * 50
    seg = Segment(0.0, 6.0, f"see {url} for the full list of changes in this release")
    cs = cues([seg])
    assert_follows_rules(as_tuples(cs), [seg])
    long_lines = [line for c in cs for line in c.lines if len(line) > RULES.max_line_chars]
    assert long_lines == [url]


def test_overlapping_segments_give_cues_that_do_not_overlap() -> None:
    segs = [Segment(0.0, 5.0, "first segment of speech"), Segment(4.0, 8.0, "second one starts early"),
            Segment(7.5, 7.6, "third")]
    assert_follows_rules(as_tuples(cues(segs)), segs)


def test_other_rules() -> None:
    rules = CueRules(max_line_chars=16, max_lines=1, max_cue_s=3.0)
    seg = Segment(0.0, 20.0, words_text(40, seed=4))
    assert_follows_rules(as_tuples(cues([seg], rules)), [seg], rules)


def test_random_segments_follow_the_rules() -> None:
    rng = random.Random(7)
    for trial in range(40):
        segs, t = [], rng.uniform(0, 4000)
        for k in range(rng.randint(0, 4)):
            text = words_text(rng.randint(0, 120), seed=trial * 10 + k)
            if rng.random() < 0.1:
                text += " " + "x" * rng.randint(43, 70)
            span = rng.uniform(0.0, 40.0)
            words: tuple[Word, ...] = ()
            if rng.random() < 0.5 and text:
                step = span / len(text.split())
                words = tuple(Word(w, t + i * step, t + (i + rng.uniform(0.3, 1.0)) * step)
                              for i, w in enumerate(text.split()))
            segs.append(Segment(t, t + span, text, words=words))
            t += span + rng.uniform(-1.0, 2.0)  # sometimes overlapping the previous segment
        assert_follows_rules(as_tuples(cues(segs)), segs)
