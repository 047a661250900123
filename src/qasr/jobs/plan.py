"""Folder jobs: which files to transcribe, where each one's outputs go, and which are already done.

Output paths mirror the inputs' paths relative to their common ancestor, so ``a/clip.wav`` and
``b/clip.wav`` land in ``OUT/a/`` and ``OUT/b/``. Outputs are named by the input's stem (``clip.srt``
beside ``clip.mp4``, as video players expect); two inputs in one folder with the same stem
(``clip.wav``, ``clip.flac``) keep their extension (``clip.wav.srt``, ``clip.flac.srt``) so neither
result overwrites the other. Every output is written atomically, so an input counts as done exactly
when all of its requested outputs exist: a rerun skips it, and an interrupted one is redone whole.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Containers we look for inside folders (files named on the command line are taken whatever their name).
MEDIA_EXTENSIONS = frozenset({
    ".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".m4b", ".aac", ".wma", ".aif", ".aiff",
    ".amr", ".ac3", ".caf", ".mka", ".wv", ".webm", ".mp4", ".m4v", ".mkv", ".mov", ".avi", ".flv",
    ".mpg", ".mpeg", ".ts", ".3gp",
})
FAILED_LIST = "failed.tsv"


@dataclass(frozen=True)
class Job:
    source: str  # the input as the user named it (or as found inside a named folder)
    base: Path | None  # output path without the format suffix; None when printing to stdout

    def output(self, fmt: str) -> Path:
        assert self.base is not None
        return self.base.with_name(f"{self.base.name}.{fmt}")

    def done(self, formats: tuple[str, ...]) -> bool:
        return self.base is not None and all(self.output(fmt).is_file() for fmt in formats)


def find_inputs(args: list[str], recursive: bool = False) -> list[str]:
    """Expand folders into the media files they hold (sorted; subfolders only with ``recursive``).

    Files and anything that is not a folder (a missing path, a URL) are kept as given, so that they
    fail with their own message instead of vanishing. Duplicates are dropped.
    """
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
    """One Job per input with its output base path under ``out_dir`` (see the module docstring)."""
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


def probe_duration(path: str) -> float | None:
    """The input's duration from its header (no decoding), or None when the container does not say or
    cannot be opened: the duration the block decoder, and so the progress it reports, starts from."""
    from qasr.audio.decode_blocks import BlockDecoder  # imported here: --help stays free of the decoders
    from qasr.audio.io import AudioError

    try:
        return BlockDecoder(lambda: path, path, block_s=1.0).duration
    except (AudioError, OSError):  # unreadable: the transcription reports why
        return None


def update_failed_list(out_dir: Path | None, failures: list[tuple[str, str]]) -> None:
    """Write ``OUT/failed.tsv`` for this run's failures, or remove a stale one when there are none."""
    from qasr.outputs.writers import write_atomic

    if out_dir is None:
        return
    path = out_dir / FAILED_LIST
    if failures:
        write_atomic(path, failed_list_text(failures))
    else:
        path.unlink(missing_ok=True)  # a list from an earlier run would name inputs that are now done


def report_failures(out_dir: Path | None, failures: list[tuple[str, str]], count: int) -> None:
    """The end of a run: ``OUT/failed.tsv`` written (or a stale one removed), and one line on stderr saying
    how many of the ``count`` inputs failed and where they are listed."""
    update_failed_list(out_dir, failures)
    if failures:
        where = f" (listed in {out_dir / FAILED_LIST})" if out_dir is not None else ""
        print(f"qasr: {len(failures)} of {count} inputs failed{where}", file=sys.stderr)


def failed_list_text(failures: list[tuple[str, str]]) -> str:
    """``OUT/failed.tsv``: one line per failed input with its reason (tabs and newlines made spaces)."""
    lines = ["input\terror"]
    for source, error in failures:
        lines.append(f"{_cell(source)}\t{_cell(error)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.replace("\t", " ").split())
