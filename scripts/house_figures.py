"""The house rules as numbers: prose share of src/, notebook lines, timing figures in prose, the API's width.

`python scripts/house_figures.py` prints the figures; `--check` exits 1 when src/ holds a notebook line
(what `make lint` runs). See docs/contributing.md for the rules.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "qasr"

# A notebook line: a dated or machine-bound observation, or a story of the work, none of which belongs in code.
NOTEBOOK = re.compile(
    r"\b(20[12]\d-[01]\d-[0-3]\d"
    r"|(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20[12]\d"
    r"|Xeon|EPYC|Sapphire Rapids|Granite Rapids|Zen ?[2-5]|Ryzen|this session|last session|today|yesterday"
    r"|[Tt]ried and|we tried|was tried|measured on|profiler)\b"
)
# A pointer to a log entry is how code names the measurement behind a reason: its date is not a notebook line.
LOG_POINTER = re.compile(r"docs/log/[^\s)`'\"]*")
# A figure of time, speed-up or share in prose: "1.67 ms", "3.5x", "12 us", "40%".
TIMING = re.compile(r"\b\d+(\.\d+)?\s?(ms|us|µs|ns|x|%)(?![A-Za-z0-9_])|\b\d+\.\d+\s?s\b")


def prose_spans(text: str) -> tuple[list[str], int]:
    """The comment and docstring texts of one Python file, and its non-space character count."""
    total = len(re.sub(r"\s", "", text))
    spans: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            spans.append(tok.string)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    spans.append(body[0].value.value)
    return spans, total


def cpp_prose(text: str) -> list[str]:
    return re.findall(r"//[^\n]*|/\*.*?\*/", text, flags=re.S)


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python, C++ or header file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        lines = []
        for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, flags=re.S):
            first = text.count("\n", 0, m.start()) + 1
            lines += [(first + i, line) for i, line in enumerate(m.group().splitlines())]
        return lines
    lines = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    first = body[0].lineno
                    lines += [(first + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    return sorted(lines)


def notebook_lines(paths: list[Path]) -> list[str]:
    """Every prose line of the given files that reads as a lab notebook, as 'path:line: text'."""
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
            for path in paths for n, line in prose_lines(path) if NOTEBOOK.search(LOG_POINTER.sub("", line))]


def source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*") if p.suffix in {".py", ".cpp", ".h"})


def figures() -> dict[str, object]:
    prose = total = 0
    timing_lines = 0
    for path in source_files():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            spans, n = prose_spans(text)
            total += n
        else:
            spans = cpp_prose(text)
        prose += sum(len(re.sub(r"\s", "", s)) for s in spans) if path.suffix == ".py" else 0
        timing_lines += sum(1 for s in spans for line in s.splitlines() if TIMING.search(line))
    from qasr import ASR  # noqa: PLC0415 - the figure is of the installed package

    public = [n for n in vars(ASR) if not n.startswith("_")]
    widest = 0
    for name in public:
        fn = getattr(ASR, name)
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            widest = max(widest, code.co_argcount + code.co_kwonlyargcount - 1)
    segment_files = sum(1 for p in source_files() if "max_segment_s" in p.read_text(encoding="utf-8"))
    tests = [p for p in (ROOT / "tests").rglob("test_*.py")]
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("_")} | {"e2e"}
    in_folder = sum(1 for p in tests if p.relative_to(ROOT / "tests").parts[0] in packages)
    return {
        "prose share of src/qasr/**/*.py": round(prose / total, 3),
        "notebook lines in src/": len(notebook_lines(source_files())),
        "prose lines with timing figures (py and C++)": timing_lines,
        "ASR public members": len(public),
        "widest ASR public signature (named parameters)": widest,
        "files under src/qasr naming max_segment_s": segment_files,
        "test files in a package or e2e folder": f"{in_folder} of {len(tests)}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when src/ holds a notebook line")
    args = parser.parse_args()
    if args.check:
        bad = notebook_lines(source_files())
        for line in bad:
            print(f"notebook line in src/: {line}", file=sys.stderr)
        return 1 if bad else 0
    for key, value in figures().items():
        print(f"{key:50s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
