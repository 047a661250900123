"""Segments -> subtitle cues, for the srt, vtt and tsv writers; the rules are in docs/output-formats.md."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from qasr.results import Segment


@dataclass(frozen=True)
class CueRules:
    max_line_chars: int = 42
    max_lines: int = 2
    max_cue_s: float = 7.0
    # with word times, a longer gap between words ends the cue; None: pauses never do
    max_pause_s: float | None = 0.5

    def __post_init__(self) -> None:
        if self.max_pause_s is not None and not self.max_pause_s >= 0:
            raise ValueError(f"max_pause_s must be None or >= 0, got {self.max_pause_s!r}")


DEFAULT_RULES = CueRules()


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str  # one line: what tsv writes
    lines: tuple[str, ...]  # wrapped: what srt and vtt write
    probability: float | None = None  # its least sure word's


@dataclass(frozen=True)
class _Unit:
    text: str
    space_before: bool
    start: float
    end: float
    probability: float | None = None


def _wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in ("W", "F")


def _closing(ch: str) -> bool:
    return unicodedata.category(ch) in ("Po", "Pe", "Pf")


_SENTENCE_ENDS = frozenset(".?!…。？！．｡‼⁇⁈⁉")
_CLAUSE_ENDS = frozenset(",;:，、；：､—–")
_BREAK_COST = {"sentence": 0, "clause": 1, "word": 3}


def _break_cost(text: str) -> int:
    """The cost of ending a cue after ``text``, by its last mark past closing quotes."""
    end = text
    while end and (end[-1] in "\"'" or unicodedata.category(end[-1]) in ("Pe", "Pf")):
        end = end[:-1]
    if end and end[-1] in _SENTENCE_ENDS:
        return _BREAK_COST["sentence"]
    if end and end[-1] in _CLAUSE_ENDS:
        return _BREAK_COST["clause"]
    return _BREAK_COST["word"]


def _split_token(token: str) -> list[str]:
    """A space-free token -> units: each wide character alone, other runs whole."""
    pieces: list[str] = []
    for ch in token:
        if pieces and _wide(ch) and _closing(ch):
            pieces[-1] += ch
        elif not pieces or _wide(ch) or _wide(pieces[-1][-1]):
            pieces.append(ch)
        else:
            pieces[-1] += ch
    return pieces


def _join(units: list[_Unit]) -> str:
    return "".join((" " if u.space_before and i else "") + u.text for i, u in enumerate(units))


def _untimed_units(seg: Segment) -> list[_Unit]:
    texts: list[tuple[str, bool]] = []
    for token in seg.text.split():
        texts += [(piece, i == 0) for i, piece in enumerate(_split_token(token))]
    total = sum(len(t) for t, _ in texts)
    span = max(seg.end - seg.start, 0.0)
    units, done = [], 0
    for text, space in texts:
        start = seg.start + span * done / total
        done += len(text)
        units.append(_Unit(text, space, start, seg.start + span * done / total))
    return units


def _timed_units(seg: Segment) -> list[_Unit]:
    units: list[_Unit] = []
    for w in seg.words:
        text = " ".join(w.text.split())
        if not text:
            continue
        space = bool(units) and not (_wide(units[-1].text[-1]) or _wide(text[0]))
        start = max(w.start, units[-1].end) if units else w.start
        units.append(_Unit(text, space, start, max(w.end, start), w.probability))
    return units


def _gap(u: _Unit, line_len: int) -> int:
    return 1 if u.space_before and line_len else 0


def _greedy_lines(units: list[_Unit], width: int) -> list[list[_Unit]]:
    lines: list[list[_Unit]] = []
    length = 0
    for u in units:
        if lines and length + _gap(u, length) + len(u.text) <= width:
            lines[-1].append(u)
            length += _gap(u, length) + len(u.text)
        else:
            lines.append([u])
            length = len(u.text)
    return lines


def _wrap(units: list[_Unit], rules: CueRules) -> list[list[_Unit]]:
    """Balanced lines: the narrowest width needing no more lines than the full width."""
    need = len(_greedy_lines(units, rules.max_line_chars))
    lo, hi = 1, rules.max_line_chars
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_lines(units, mid)) <= need:
            hi = mid
        else:
            lo = mid + 1
    return _greedy_lines(units, lo)


def _pause_runs(units: list[_Unit], rules: CueRules) -> list[list[_Unit]]:
    if rules.max_pause_s is None:
        return [units]
    runs = [[units[0]]]
    for prev, u in zip(units, units[1:], strict=False):
        if u.start - prev.end > rules.max_pause_s + 1e-9:
            runs.append([u])
        else:
            runs[-1].append(u)
    return runs


def _partition(units: list[_Unit], rules: CueRules, punctuation: bool = False) -> list[list[_Unit]]:
    """Fewest cues; then, with ``punctuation``, the cheapest ends; then the least sum of squared lengths."""
    n = len(units)
    cost = [_break_cost(u.text) if punctuation else 0 for u in units[:-1]] + [0]
    # (cues, cost of the ends, sum of squares, end of first cue)
    best: list[tuple[int, int, int, int]] = [(0, 0, 0, n)] * (n + 1)
    for i in range(n - 1, -1, -1):
        lines, length, size = 1, len(units[i].text), len(units[i].text)
        options = [(best[i + 1][0] + 1, best[i + 1][1] + cost[i], best[i + 1][2] + size * size, i + 1)]
        for j in range(i + 1, n):
            u = units[j]
            if u.end - units[i].start > rules.max_cue_s + 1e-9:
                break
            size += _gap(u, size) + len(u.text)
            if length + _gap(u, length) + len(u.text) <= rules.max_line_chars:
                length += _gap(u, length) + len(u.text)
            else:
                lines, length = lines + 1, len(u.text)
            if lines > rules.max_lines:
                break
            options.append((best[j + 1][0] + 1, best[j + 1][1] + cost[j], best[j + 1][2] + size * size, j + 1))
        best[i] = min(options)
    groups, i = [], 0
    while i < n:
        groups.append(units[i:best[i][3]])
        i = best[i][3]
    return groups


def cues(segments: Iterable[Segment], rules: CueRules = DEFAULT_RULES) -> list[Cue]:
    """Cues in time order, never overlapping, of segments in time order."""
    out: list[Cue] = []
    for seg in segments:
        units = _timed_units(seg) if seg.words else _untimed_units(seg)
        if not units:
            continue
        runs = _pause_runs(units, rules) if seg.words else [units]
        groups = [g for run in runs for g in _partition(run, rules, punctuation=bool(seg.words))]
        for group in groups:
            start = max(group[0].start, out[-1].end) if out else group[0].start
            end = min(max(group[-1].end, start), start + rules.max_cue_s)
            lines = tuple(_join(line) for line in _wrap(group, rules))
            scores = [u.probability for u in group]
            probability = min(scores) if seg.words and None not in scores else None  # type: ignore[type-var]
            out.append(Cue(start, end, _join(group), lines, probability))
    return out
