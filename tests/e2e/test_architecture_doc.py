"""docs/architecture.md's tree names every module of src/qasr, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "qasr"


def documented() -> tuple[set[str], dict[str, str]]:
    """The paths the tree names, and each folder's own line (where a folder lists its files inline)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    paths: set[str] = set()
    folder_lines: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last = ""
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m or m.group(2) == "src/qasr/":
            continue
        indent, name = len(m.group(1)), m.group(2)
        if indent > 10:  # a description's continuation (entries nest two spaces a level)
            if last in folder_lines:
                folder_lines[last] += line
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([p for _, p in stack] + [name.rstrip("/")])
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
            folder_lines[path] = line
        paths.add(path)
        last = path
    return paths, folder_lines


def modules() -> set[str]:
    found = set()
    for p in SRC.rglob("*"):
        if p.suffix not in {".py", ".cpp", ".h"} or "__pycache__" in p.parts:
            continue
        rel = p.relative_to(SRC).as_posix()
        if p.name == "__init__.py" and p.parent != SRC:
            continue  # a package's face: its folder is named
        found.add(rel)
    return found


def test_every_module_is_named_in_the_tree() -> None:
    paths, folder_lines = documented()
    missing = sorted(m for m in modules() if m not in paths
                     and Path(m).name not in folder_lines.get(str(Path(m).parent), ""))
    assert not missing, f"docs/architecture.md's tree does not name: {missing}"


def test_the_tree_names_no_module_that_is_gone() -> None:
    paths, _ = documented()
    gone = sorted(p for p in paths if not (SRC / p).exists())
    assert not gone, f"docs/architecture.md's tree names modules that do not exist: {gone}"
