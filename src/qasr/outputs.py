"""Writers for transcription results; files are written atomically (temp file + rename)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from qasr.results import Transcription

FORMATS = ("txt", "json")


def render(result: Transcription, fmt: str) -> str:
    if fmt == "txt":
        return result.text + "\n"
    if fmt == "json":
        return json.dumps(result.to_dict(), ensure_ascii=False, indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def write_atomic(path: Path, text: str) -> None:
    """Never leave a half-written file: write next to the target, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def output_path(out_dir: Path, source: str, fmt: str) -> Path:
    return out_dir / f"{Path(source).stem}.{fmt}"
