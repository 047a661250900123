"""Inputs of a Ray job: local paths as in ``qasr.jobs.plan``, plus URIs of any pyarrow filesystem.

``s3://bucket/talks/``, ``gs://...``, ``hdfs://...``, ``abfs://...`` or ``file:///...`` name a file or a
folder; folders are listed with pyarrow (sorted, media extensions only, subfolders with ``--recursive``)
exactly as local folders are. On a cluster a local path must be visible to every node (a shared mount);
a URI is read by whichever worker decodes it.

Output paths come from ``qasr.jobs.plan.plan_jobs``: a URI takes part as the path ``/<scheme>/<rest>``, so a
folder of URIs mirrors under OUT like a local folder does, and the stem rules are the same.
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
    """``(pyarrow filesystem, path in it)``; raises ValueError (pyarrow's ArrowInvalid) for an unknown scheme."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri)


def read_uri(uri: str) -> bytes:
    """The whole file behind a URI (decoders take bytes; a worker holds one input at a time)."""
    filesystem, path = open_uri(uri)
    with filesystem.open_input_stream(path) as stream:  # type: ignore[attr-defined]
        return stream.readall()


def _list_uri(uri: str, recursive: bool) -> list[str]:
    """The media files under a folder URI (sorted), or ``[uri]`` for a file or anything unreadable, which
    then fails with its own message when it is decoded."""
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
    """``qasr.jobs.plan.find_inputs`` for local paths, pyarrow listings for URIs; order kept, duplicates dropped."""
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
    """``qasr.jobs.plan.plan_jobs`` with URIs placed as ``/<scheme>/<rest>``; each Job keeps its real source."""
    planned = plan_local_jobs([_key(s) for s in sources], out_dir)
    return [Job(source, job.base) for source, job in zip(sources, planned, strict=True)]
