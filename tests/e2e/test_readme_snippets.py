"""Every ```python block of README.md and docs/*.md is a valid .py file as written (a top-level ``await``, fine in
a notebook, is a SyntaxError there), and the README's first snippet runs on the demo model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)


def python_blocks() -> list[tuple[str, str]]:
    """(``doc:line``, code) for every ```python block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in PYTHON_BLOCK.finditer(text):
            found.append((f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return found


def test_the_docs_have_python_blocks() -> None:
    where = [w for w, _ in python_blocks()]
    assert len(where) >= 10 and any(w.startswith("README.md:") for w in where)


@pytest.mark.parametrize(("where", "code"), [pytest.param(w, c, id=w) for w, c in python_blocks()])
def test_a_python_block_compiles(where: str, code: str) -> None:
    try:
        compile(code, where, "exec")
    except SyntaxError as exc:
        pytest.fail(f"{where} (line {exc.lineno} of the block): {exc.msg}; a snippet must run as a .py file "
                    "(wrap awaits in `async def main(): ...` and `asyncio.run(main())`)")


def test_a_top_level_await_is_caught() -> None:
    with pytest.raises(SyntaxError):
        compile("results = await asr.transcribe_async(['talk.mp3'])\n", "snippet", "exec")


def test_the_readme_usage_snippet_runs_on_the_demo_model(tmp_path: Path) -> None:
    where, code = next((w, c) for w, c in python_blocks() if w.startswith("README.md:") and "transcribe_async" in c)
    code = (code.replace('"Qwen/Qwen3-ASR-0.6B"', repr(str(ROOT / "models" / "qasr-demo-en")))
            .replace('"talk.mp3"', repr(str(ROOT / "examples" / "alarm.flac")))
            .replace('"call.wav"', repr(str(ROOT / "examples" / "math.flac"))))
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{where}:\n{run.stderr[-3000:]}"
    assert "alarm" in run.stdout.lower(), run.stdout
