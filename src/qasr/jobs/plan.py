"""Folder jobs: the inputs, their output paths (mirroring the inputs' below their common folder), and
which are done (all requested outputs exist: each is written atomically)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# what is looked for inside folders (files named on the command line are taken whatever their name)
MEDIA_EXTENSIONS = frozenset({
    ".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".m4b", ".aac", ".wma", ".aif", ".aiff",
    ".amr", ".ac3", ".caf", ".mka", ".wv", ".webm", ".mp4", ".m4v", ".mkv", ".mov", ".avi", ".flv",
    ".mpg", ".mpeg", ".ts", ".3gp",
})
FAILED_LIST = "failed.tsv"


@dataclass(frozen=True)
class Job:
    source: str
    base: Path | None  # output path without the format suffix; None when printing to stdout

    def output(self, fmt: str) -> Path:
        assert self.base is not None
        return self.base.with_name(f"{self.base.name}.{fmt}")

    def done(self, formats: tuple[str, ...]) -> bool:
        return self.base is not None and all(self.output(fmt).is_file() for fmt in formats)


def find_inputs(args: list[str], recursive: bool = False) -> list[str]:
    """Folders expanded into their media files (sorted); anything else kept as given, to fail with its own
    message; duplicates dropped."""
    found: list[str] = []
    for arg in args:
        if os.path.isdir(arg):
            found += _media_in(Path(arg), recursive)
        else:
            found.append(arg)
    seen: set[str] = set()
    unique = []
    for path in found:
        key = os.path.realpath(path) if os.path.exists(path) else path
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def _media_in(folder: Path, recursive: bool) -> list[str]:
    pattern = "**/*" if recursive else "*"
    return sorted(str(p) for p in folder.glob(pattern) if p.suffix.lower() in MEDIA_EXTENSIONS and p.is_file())


def plan_jobs(sources: list[str], out_dir: Path | None) -> list[Job]:
    """One Job per input; two inputs of one folder with one stem keep their extension (``clip.wav.srt``)."""
    if out_dir is None:
        return [Job(s, None) for s in sources]
    absolute = [Path(os.path.abspath(s)) for s in sources]
    root = Path(os.path.commonpath([p.parent for p in absolute])) if absolute else Path(".")
    relative = [p.relative_to(root) for p in absolute]
    stems = Counter((r.parent, r.stem) for r in relative)
    jobs = []
    for source, rel in zip(sources, relative, strict=True):
        name = rel.name if stems[(rel.parent, rel.stem)] > 1 else rel.stem
        jobs.append(Job(source, out_dir / rel.parent / name))
    return jobs


def update_failed_list(out_dir: Path | None, failures: list[tuple[str, str]]) -> None:
    """``OUT/failed.tsv`` of this run's failures, or none."""
    from qasr.outputs.writers import write_atomic

    if out_dir is None:
        return
    path = out_dir / FAILED_LIST
    if failures:
        write_atomic(path, failed_list_text(failures))
    else:
        path.unlink(missing_ok=True)


def report_failures(out_dir: Path | None, failures: list[tuple[str, str]], count: int) -> None:
    """The end of a run: ``OUT/failed.tsv``, and one line on stderr saying how many failed."""
    update_failed_list(out_dir, failures)
    if failures:
        where = f" (listed in {out_dir / FAILED_LIST})" if out_dir is not None else ""
        print(f"qasr: {len(failures)} of {count} inputs failed{where}", file=sys.stderr)


def failed_list_text(failures: list[tuple[str, str]]) -> str:
    """One line per failed input with its reason."""
    lines = ["input\terror"]
    for source, error in failures:
        lines.append(f"{_cell(source)}\t{_cell(error)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.replace("\t", " ").split())
