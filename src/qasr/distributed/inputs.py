"""Inputs of a Ray job: local paths as in ``qasr.jobs.plan``, plus pyarrow URIs (``s3://``, ``gs://``...),
whose outputs are planned as the path ``/<scheme>/<rest>``.
"""

from __future__ import annotations

import re
from pathlib import Path

from qasr.jobs.plan import MEDIA_EXTENSIONS, Job
from qasr.jobs.plan import find_inputs as find_local_inputs
from qasr.jobs.plan import plan_jobs as plan_local_jobs

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def is_uri(text: str) -> bool:
    return bool(_URI.match(text))


def open_uri(uri: str) -> tuple[object, str]:
    """``(pyarrow filesystem, path in it)``; ValueError for an unknown scheme."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri)


def read_uri(uri: str) -> bytes:
    """The whole file behind a URI (decoders take bytes)."""
    filesystem, path = open_uri(uri)
    with filesystem.open_input_stream(path) as stream:  # type: ignore[attr-defined]
        return stream.readall()


def _list_uri(uri: str, recursive: bool) -> list[str]:
    """The media files under a folder URI (sorted), or ``[uri]`` for anything else."""
    from pyarrow import fs

    try:
        filesystem, path = open_uri(uri)
        if filesystem.get_file_info(path).type != fs.FileType.Directory:  # type: ignore[attr-defined]
            return [uri]
        infos = filesystem.get_file_info(fs.FileSelector(path, recursive=recursive))  # type: ignore[attr-defined]
    except (OSError, ValueError):
        return [uri]
    base, root = uri.rstrip("/"), path.rstrip("/")
    found = [base + "/" + info.path[len(root):].lstrip("/") for info in infos
             if info.type == fs.FileType.File and Path(info.path).suffix.lower() in MEDIA_EXTENSIONS]
    return sorted(found)


def find_inputs(args: list[str], recursive: bool = False) -> list[str]:
    """``jobs.plan.find_inputs`` for paths, pyarrow listings for URIs; order kept, duplicates dropped."""
    found: list[str] = []
    for arg in args:
        found += _list_uri(arg, recursive) if is_uri(arg) else find_local_inputs([arg], recursive)
    local = find_local_inputs([f for f in found if not is_uri(f)])  # its duplicate rule (real paths)
    keep = set(local)
    unique, seen = [], set()
    for f in found:
        if (is_uri(f) or f in keep) and f not in seen:
            seen.add(f)
            unique.append(f)
    return unique


def _key(source: str) -> str:
    match = _URI.match(source)
    return source if match is None else f"/{match.group(1)}/{match.group(2)}"


def plan_jobs(sources: list[str], out_dir: Path | None) -> list[Job]:
    """``jobs.plan.plan_jobs`` with URIs as ``/<scheme>/<rest>``; each Job keeps its real source."""
    planned = plan_local_jobs([_key(s) for s in sources], out_dir)
    return [Job(source, job.base) for source, job in zip(sources, planned, strict=True)]
