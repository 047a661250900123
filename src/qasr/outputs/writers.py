"""The output formats (docs/output-formats.md), and atomic files."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from qasr.outputs.subtitles import DEFAULT_RULES, Cue, CueRules, cues
from qasr.results import Segment, Transcription

FORMATS = ("txt", "json", "srt", "vtt", "tsv")


def _seconds(t: float) -> float:
    return round(t, 3)


def score(x: float | None) -> float | None:
    """A confidence score as written: 4 decimals."""
    return None if x is None else round(x, 4)


def _segment_dict(seg: Segment) -> dict:
    d: dict = {"start": _seconds(seg.start), "end": _seconds(seg.end), "text": seg.text,
               "finish_reason": seg.finish_reason, "avg_logprob": score(seg.avg_logprob),
               "compression_ratio": score(seg.compression_ratio)}
    if seg.words:
        d["words"] = [{"text": w.text, "start": _seconds(w.start), "end": _seconds(w.end),
                       "probability": score(w.probability)} for w in seg.words]
    return d


def _json(result: Transcription, compact: bool) -> str:
    data = {
        "text": result.text,
        "language": result.language,
        "duration": _seconds(result.duration),
        "finish_reason": result.finish_reason,
        "source": result.source,
        "error": result.error,
        "timestamps": result.timestamps,
        "segments": [_segment_dict(s) for s in result.segments],
    }
    return json.dumps(data, ensure_ascii=False, indent=None if compact else 2) + "\n"


def _timestamp(t: float, sep: str) -> str:
    ms = max(round(t * 1000), 0)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _srt(cs: list[Cue]) -> str:
    return "".join(
        f"{i}\n{_timestamp(c.start, ',')} --> {_timestamp(c.end, ',')}\n" + "\n".join(c.lines) + "\n\n"
        for i, c in enumerate(cs, 1))


def _vtt_escape(line: str) -> str:
    # cue text is markup in WebVTT
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _vtt(cs: list[Cue]) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{_timestamp(c.start, '.')} --> {_timestamp(c.end, '.')}\n"
        + "\n".join(_vtt_escape(line) for line in c.lines) + "\n\n"
        for c in cs)


def _tsv(cs: list[Cue]) -> str:
    scored = bool(cs) and all(c.probability is not None for c in cs)
    rows = ["start\tend\ttext" + ("\tprobability" if scored else "")]
    rows += [f"{round(c.start * 1000)}\t{round(c.end * 1000)}\t{' '.join(c.text.split())}"
             + (f"\t{score(c.probability)}" if scored else "") for c in cs]
    return "\n".join(rows) + "\n"


def render(result: Transcription, fmt: str, *, compact: bool = False, rules: CueRules = DEFAULT_RULES) -> str:
    """The result as text in ``fmt`` (one of FORMATS); ``compact``: json on one line; ``rules``: the cues'."""
    if fmt == "txt":
        return result.text + "\n"
    if fmt == "json":
        return _json(result, compact)
    writers = {"srt": _srt, "vtt": _vtt, "tsv": _tsv}
    if fmt in writers:
        return writers[fmt](cues(result.segments, rules))
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def write_atomic(path: Path, text: str) -> None:
    """A temp file beside ``path``, renamed over it: never a half-written file. Mode 0o666 under the umask,
    as any new file; removed on any failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # the creation inside the cleanup's reach: a Ctrl-C may land just after os.open returns
    tmp: Path | None = None
    try:
        while True:
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:  # another writer's: pick another name
                tmp = None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename shows it
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


def output_path(out_dir: Path, source: str, fmt: str) -> Path:
    return out_dir / f"{Path(source).stem}.{fmt}"
