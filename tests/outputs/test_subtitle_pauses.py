"""Cues with word times end at pauses, and prefer sentence ends, then clause punctuation.

Synthetic word times test the rules exactly; one real espeak-ng file with pauses between sentences,
transcribed by the demo model and timed by the demo aligner, tests them on what users get.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from test_subtitles import as_tuples, assert_follows_rules

from qasr import ASR, Aligner, TranscribeOptions
from qasr.outputs.subtitles import DEFAULT_RULES, CueRules, cues
from qasr.outputs.writers import render
from qasr.results import Segment, Transcription, Word
from qasr.testing.speech import speak

ROOT = Path(__file__).resolve().parents[2]
SR = 16000


def timed(text: str, start: float = 0.0, word_s: float = 0.3, gap_s: float = 0.05,
          pauses: dict[int, float] | None = None) -> Segment:
    """A segment whose words last ``word_s`` each, ``gap_s`` apart; ``pauses[i]`` is the gap before word i."""
    words, t = [], start
    for i, w in enumerate(text.split()):
        if i:
            t += (pauses or {}).get(i, gap_s)
        words.append(Word(w, round(t, 3), round(t + word_s, 3)))
        t += word_s
    return Segment(start, t, text, words=tuple(words))


def spans_of(cs, seg: Segment) -> list[list[Word]]:
    """The words of each cue, in order (cue texts are the words joined by spaces)."""
    out, i = [], 0
    for c in cs:
        n = len(c.text.split())
        out.append(list(seg.words[i:i + n]))
        assert " ".join(w.text for w in out[-1]) == c.text
        i += n
    assert i == len(seg.words)
    return out


def test_the_issue_example_is_two_cues() -> None:
    """Measured by a user: one cue from 4.96 to 10.40 s across a 2 s silence."""
    seg = timed("wake me up at seven the code is k four z nine", start=4.96, pauses={5: 2.0})
    cs = cues([seg])
    assert [c.text for c in cs] == ["wake me up at seven", "the code is k four z nine"]
    assert cs[0].end == seg.words[4].end and cs[1].start == seg.words[5].start


def test_no_cue_spans_a_gap_above_the_threshold() -> None:
    rng = random.Random(3)
    words, t = [], 1.0
    for i in range(300):
        dur = rng.uniform(0.08, 0.6)
        words.append(Word(f"w{i}" * rng.randint(1, 3), round(t, 3), round(t + dur, 3)))
        t += dur + rng.choice([0.0, 0.02, 0.1, 0.3, 0.45, 0.5, 0.55, 0.8, 1.5, 3.0])
    seg = Segment(1.0, t, " ".join(w.text for w in words), words=tuple(words))
    for rules in (DEFAULT_RULES, CueRules(max_pause_s=0.25), CueRules(max_pause_s=1.0)):
        cs = cues([seg], rules)
        assert_follows_rules(as_tuples(cs), [seg], rules)
        groups = spans_of(cs, seg)
        for group in groups:
            assert all(b.start - a.end <= rules.max_pause_s + 1e-9 for a, b in zip(group, group[1:], strict=False))
        # and every such gap does end a cue
        ends = {id(g[-1]) for g in groups}
        long_gaps = [a for a, b in zip(words, words[1:], strict=False) if b.start - a.end > rules.max_pause_s + 1e-9]
        assert long_gaps and all(id(a) in ends for a in long_gaps)


def test_the_threshold_is_a_cue_rule() -> None:
    seg = timed("wake me up at seven the code is k four z nine", pauses={5: 0.9})
    assert DEFAULT_RULES.max_pause_s == 0.5
    assert len(cues([seg])) == 2
    assert len(cues([seg], CueRules(max_pause_s=1.0))) == 1
    assert len(cues([seg], CueRules(max_pause_s=0.9))) == 1  # a gap of exactly the threshold is allowed
    assert len(cues([seg], CueRules(max_pause_s=None))) == 1  # None: pauses never end a cue
    with pytest.raises(ValueError, match="max_pause_s"):
        CueRules(max_pause_s=-0.1)


def test_a_sentence_end_is_preferred_to_a_mid_clause_split() -> None:
    """Too long for one cue (16 words, 8 s): the cut falls after "thirty.", not mid-sentence as before."""
    seg = timed("Book a table for three people at eight thirty. Remind me to walk the dog tonight.",
                word_s=0.45, gap_s=0.05)
    assert [c.text for c in cues([seg])] == ["Book a table for three people at eight thirty.",
                                             "Remind me to walk the dog tonight."]
    # question and exclamation marks end sentences too, also before a closing quote
    seg = timed('He asked "is it ready?" She said it was ready and then left the room for the night', word_s=0.4)
    assert cues([seg])[0].text == 'He asked "is it ready?"'


def test_clause_punctuation_is_preferred_when_there_is_no_sentence_end() -> None:
    text = "if the train is late tomorrow morning, call the office and tell them that I will be there by ten"
    seg = timed(text, word_s=0.3, gap_s=0.05)  # 20 words, 7 s: two cues
    assert [c.text for c in cues([seg])] == ["if the train is late tomorrow morning,",
                                             "call the office and tell them that I will be there by ten"]


def test_cjk_sentence_ends_are_preferred() -> None:
    text = "今天天气很好我们去公园散步吧。明天可能会下雨所以要带伞"  # one unit per character, "吧。" together
    units = ["今", "天", "天", "气", "很", "好", "我", "们", "去", "公", "园", "散", "步", "吧。",
             "明", "天", "可", "能", "会", "下", "雨", "所", "以", "要", "带", "伞"]
    words = tuple(Word(u, 0.3 * i, 0.3 * i + 0.25) for i, u in enumerate(units))  # 7.75 s: two cues
    cs = cues([Segment(0.0, 8.0, text, words=words)], CueRules(max_line_chars=16))
    assert [c.text for c in cs] == ["今天天气很好我们去公园散步吧。", "明天可能会下雨所以要带伞"]


# srt and tsv of a fixed input without word times, as written before pauses and punctuation counted:
# segment times and the proportional split are unchanged (the "Is / that right?" break stays).
UNTIMED = (Segment(0.0, 9.5, "Wake me up at seven, please. The code is K four Z nine! Is that right? "
                             "Book a table for three people at eight thirty."),
           Segment(11.0, 14.0, "今天天气很好，我们去公园散步吧。明天可能会下雨，所以要带伞。"))
UNTIMED_SRT = ("1\n00:00:00,000 --> 00:00:04,597\nWake me up at seven, please.\nThe code is K four Z nine! Is\n\n"
               "2\n00:00:04,597 --> 00:00:09,500\nthat right? Book a table for\nthree people at eight thirty.\n\n"
               "3\n00:00:11,000 --> 00:00:14,000\n今天天气很好，我们去公园散步吧。明天可能会下雨，所以要带伞。\n\n")
UNTIMED_TSV = ("start\tend\ttext\n0\t4597\tWake me up at seven, please. The code is K four Z nine! Is\n"
               "4597\t9500\tthat right? Book a table for three people at eight thirty.\n"
               "11000\t14000\t今天天气很好，我们去公园散步吧。明天可能会下雨，所以要带伞。\n")


def test_without_word_times_the_output_is_unchanged() -> None:
    result = Transcription(text="", language="English", duration=15.0, segments=UNTIMED)
    assert render(result, "srt") == UNTIMED_SRT
    assert render(result, "tsv") == UNTIMED_TSV
    assert render(result, "vtt") == "WEBVTT\n\n" + "".join(
        block.split("\n", 1)[1].replace(",", ".", 2) + "\n\n" for block in UNTIMED_SRT.strip().split("\n\n"))


# ---- real speech -------------------------------------------------------------------------------------

SENTENCES = ("wake me up at seven", "the code is k four z nine", "book a table for three people at eight thirty",
             "remind me to feed the cat on friday at seven", "turn on the lamp in the hallway")
PAUSES = (2.0, 0.4, 1.0, 1.5)  # seconds of silence after each sentence but the last


@pytest.fixture(scope="module")
def spoken(tmp_path_factory) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The sentences with PAUSES between them (about 16 s: one segment), and each sentence's span."""
    d = tmp_path_factory.mktemp("pauses")
    pieces, spans, t = [np.zeros(SR // 2, np.float32)], [], 0.5
    for i, sentence in enumerate(SENTENCES):
        wave, sr = sf.read(speak(sentence, d / f"{i}.wav", voice="en-us", speed=165), dtype="float32")
        wave = soxr.resample(wave, sr, SR).astype(np.float32)
        sound = np.flatnonzero(np.abs(wave) > 1e-3)
        wave = wave[sound[0]:sound[-1] + 1]  # espeak's own silence trimmed: the pause is what we put
        pieces.append(wave)
        spans.append((t, t + len(wave) / SR))
        t += len(wave) / SR
        if i < len(PAUSES):
            pieces.append(np.zeros(round(PAUSES[i] * SR), np.float32))
            t += PAUSES[i]
    pieces.append(np.zeros(SR // 2, np.float32))
    audio = np.concatenate(pieces)
    noise = np.random.default_rng(0).standard_normal(len(audio)).astype(np.float32) * 3e-3
    return (0.5 * audio / np.abs(audio).max() + noise).astype(np.float32), spans


def test_real_speech_cues_end_at_the_pauses(spoken) -> None:
    audio, spans = spoken
    aligner = Aligner.from_pretrained(ROOT / "models" / "qasr-demo-aligner-en", device="cpu", dtype="float32")
    asr = ASR.from_pretrained(ROOT / "models" / "qasr-demo-en", device="cpu", dtype="float32", aligner=aligner)
    try:
        # one segment: cues cut it
        [r] = asr.transcribe((audio, SR), TranscribeOptions(max_segment_s=30), timestamps="word")
    finally:
        asr.close()
        aligner.close()
    assert r.ok and r.timestamps == "word" and len(r.segments) == 1, r  # the pauses all lie inside one segment
    assert r.text.split() == " ".join(SENTENCES).split(), r.text
    cs = cues(r.segments)
    assert_follows_rules(as_tuples(cs), list(r.segments))
    for pause, (_, end), (start, _) in zip(PAUSES, spans, spans[1:], strict=False):
        if pause >= 1.0:
            middle = (end + start) / 2
            # the pause lies between two cues, which break exactly at the sentence boundary
            i = next(k for k, c in enumerate(cs) if c.start > middle)
            assert i > 0 and cs[i - 1].end < middle, (pause, [(c.start, c.end, c.text) for c in cs])
    # every sentence after a pause of >= 1 s starts a cue
    for pause, before, after in zip(PAUSES, SENTENCES[:-1], SENTENCES[1:], strict=True):
        if pause >= 1.0:
            pairs = zip(cs, cs[1:], strict=False)
            assert any(a.text.endswith(before) and b.text.startswith(after) for a, b in pairs), [c.text for c in cs]
    # before: one cue ran across the 2 s pause (as reported: "wake me up at seven the / code is ...")
    assert len(cues(r.segments, CueRules(max_pause_s=None))) < len(cs)
