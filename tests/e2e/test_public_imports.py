"""Every import that README.md and docs/*.md show in a code block still works: a moved module keeps its
documented path (or the docs follow it), so a reader's copy-paste never fails."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
FROM = re.compile(r"^\s*from\s+(qasr(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
IMPORT = re.compile(r"^\s*import\s+(qasr(?:\.\w+)*(?:\s*,\s*qasr(?:\.\w+)*)*)", re.M)


def shown_imports() -> list[tuple[str, str, str | None]]:
    """(doc, module, name or None) for every ``from qasr... import ...`` / ``import qasr...`` in a code block."""
    found = []
    for doc in DOCS:
        for block in FENCE.findall(doc.read_text()):
            for module, names in FROM.findall(block):
                for name in names.strip("()").replace("\n", " ").split(","):
                    name = name.split(" as ")[0].strip()
                    if name:
                        found.append((doc.name, module, name))
            for modules in IMPORT.findall(block):
                found += [(doc.name, m.strip(), None) for m in modules.split(",")]
    return found


def test_the_docs_show_imports() -> None:
    shown = shown_imports()
    assert ("README.md", "qasr", "ASR") in shown
    assert len(shown) >= 4


@pytest.mark.parametrize(("doc", "module", "name"), shown_imports(), ids=lambda x: x or "")
def test_a_shown_import_works(doc: str, module: str, name: str | None) -> None:
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name), f"{doc}: `from {module} import {name}`: {module} has no {name}"


def test_the_old_facade_path_and_the_package_names() -> None:
    import qasr
    import qasr.api

    assert qasr.api.ASR is qasr.ASR
    for name in ("ASR", "Aligner", "Transcription", "Segment", "Word", "AudioError", "Piece"):
        assert getattr(qasr, name) is not None
