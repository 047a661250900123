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


def test_the_package_names() -> None:
    import qasr

    for name in qasr.__all__:
        assert getattr(qasr, name) is not None, name
    for name in ("ASR", "Aligner", "Transcription", "Segment", "Word", "AudioError", "Piece", "TranscribeOptions",
                 "EngineConfig", "VadConfig", "LiveConfig", "SegmentIterator", "TranscriptionFailed"):
        assert name in qasr.__all__
    with pytest.raises(ImportError):
        importlib.import_module("qasr.api")  # the old facade path is gone (0.1 owes it to no one)


def test_the_asr_facade_is_narrow() -> None:
    """At most 10 public names on an instance, and no public signature wider than 8 named parameters."""
    from qasr import ASR
    from qasr.testing import make_tiny_checkpoint

    public = [n for n in vars(ASR) if not n.startswith("_")]
    assert len(public) <= 10, public
    for name in public:
        code = getattr(getattr(getattr(ASR, name), "__func__", getattr(ASR, name)), "__code__", None)
        if code is not None:
            assert code.co_argcount + code.co_kwonlyargcount - 1 <= 8, name
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        asr = ASR.from_pretrained(make_tiny_checkpoint(Path(tmp) / "tiny", seed=0), device="cpu", dtype="float32")
        try:
            assert len([n for n in dir(asr) if not n.startswith("_")]) <= 10
        finally:
            asr.close()
