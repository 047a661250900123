"""Command line: ``qasr transcribe PATH... [-m MODEL] [--language L] [--context TEXT] [-f FMT] [-o DIR]``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from qasr import __version__

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qasr", description="Fast, exact Qwen3-ASR speech recognition.")
    parser.add_argument("--version", action="version", version=f"qasr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transcribe", help="transcribe audio files",
                       description="Transcribe audio files (wav, flac, mp3, ogg/opus, m4a, webm, ...).")
    t.add_argument("paths", nargs="+", metavar="PATH", help="audio files")
    t.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory or hub id (default {DEFAULT_MODEL})")
    t.add_argument("--language", default=None, help="force the language (name or ISO code); default: detect")
    t.add_argument("--context", default="", help="background text / hotwords for the system turn")
    t.add_argument("-f", "--format", default="txt", choices=["txt", "json"], help="output format (default txt)")
    t.add_argument("-o", "--output-dir", type=Path, default=None,
                   help="write one file per input here instead of printing to stdout")
    t.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    t.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    t.add_argument("--max-running", type=int, default=64,
                   help="sequences decoded together by the engine (default 64)")
    t.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="cap on generated tokens per piece (default: ceil(15 x seconds) + 24 for each piece; "
                        "a piece cut at the cap is reported with a warning)")
    b = sub.add_parser("bench", help="throughput benchmark against transformers (needs the test extras)",
                       add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (see qasr bench -h)")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def transcribe_command(args: argparse.Namespace) -> int:
    from qasr.api import ASR
    from qasr.engine.engine import EngineConfig
    from qasr.model.prompt import normalize_language
    from qasr.outputs import output_path, render, write_atomic

    try:
        normalize_language(args.language)
        engine = EngineConfig(max_running=args.max_running)
        asr = ASR.from_pretrained(args.model, device=args.device, dtype=args.dtype, engine=engine)
    except (ValueError, FileNotFoundError) as exc:
        print(f"qasr: error: {exc}", file=sys.stderr)
        return 2
    progress = _progress_bar(len(args.paths))
    results = asr.transcribe(args.paths, language=args.language, context=args.context,
                             max_new_tokens=args.max_new_tokens, progress=progress)
    failed = 0
    for result in results:
        if result.error is not None:
            failed += 1
            print(f"qasr: error: {result.error}", file=sys.stderr)
            continue
        text = render(result, args.format)
        if args.output_dir is None:
            sys.stdout.write(text)
        else:
            write_atomic(output_path(args.output_dir, result.source, args.format), text)
    sys.stdout.flush()
    return 1 if failed else 0


def _progress_bar(total: int):  # noqa: ANN202 - returns a callback or None
    if total < 2 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    # counted in pieces: a long input split at max_chunk_sec counts once per piece
    bar = tqdm(unit="piece", file=sys.stderr, desc=f"{total} inputs")
    return bar.update


class _CliFormatter(logging.Formatter):
    """``qasr: warning: ...``, in the style of the ``qasr: error:`` lines the command prints itself."""

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)  # a copy: other handlers keep the original
        record.levelname = record.levelname.lower()
        return super().format(record)


def _log_to_stderr() -> None:
    """Show the library's warnings (e.g. a piece cut at max_new_tokens) once, in the command's style."""
    logger = logging.getLogger("qasr")
    if logger.handlers or logging.getLogger().handlers:
        return  # the embedding program (or a test harness) configured logging: leave it alone
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CliFormatter("qasr: %(levelname)s: %(message)s"))
    logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own parser; pass everything through, -h included
        from qasr.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    if args.command == "transcribe":
        return transcribe_command(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
