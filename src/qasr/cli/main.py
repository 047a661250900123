"""Command line: ``qasr transcribe INPUTS... [-o OUT] [-f txt,json,srt,vtt,tsv] [--recursive] ...``.

Only argparse and the standard library load at import time: ``qasr --help``, ``--version`` and usage
errors answer at once, and torch loads when there is work to do.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from pathlib import Path

from qasr import __version__
from qasr.cli.argtypes import add_engine_flags, load_asr, positive_float, positive_int, probability
from qasr.transcribe.options import add_flags, from_flags, model_language  # no torch

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"
FORMATS = ("txt", "json", "srt", "vtt", "tsv")  # kept equal to qasr.outputs.writers.FORMATS (a test checks)
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qasr", description="Fast, exact Qwen3-ASR speech recognition.")
    parser.add_argument("--version", action="version", version=f"qasr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    t = sub.add_parser(
        "transcribe", help="transcribe audio and video files or folders of them",
        description="Transcribe audio and video files (wav, flac, mp3, ogg/opus, m4a, webm, mp4, ...) or "
                    "folders of them. With -o, outputs mirror the inputs' relative paths under OUT, each written "
                    "atomically; inputs whose outputs all exist are skipped (--overwrite redoes them), so "
                    "rerunning the same command after an interruption redoes only the unfinished ones. Failures "
                    "are listed in OUT/failed.tsv and make the exit status 1.")
    t.add_argument("paths", nargs="+", metavar="INPUT", help="audio/video files or folders")
    t.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory or hub id (default {DEFAULT_MODEL})")
    add_flags(t, positive={int: positive_int, float: positive_float})  # --language, --segmentation, ...
    t.add_argument("-f", "--format", default="txt", type=_formats, metavar="FMT[,FMT...]",
                   help=f"output formats, comma-separated, from {', '.join(FORMATS)} (default txt); "
                        "to stdout: one format, and json becomes JSON Lines")
    t.add_argument("-o", "--output-dir", type=Path, default=None, metavar="OUT",
                   help="write outputs under this folder instead of printing to stdout")
    t.add_argument("--overwrite", action="store_true",
                   help="transcribe inputs whose outputs exist in OUT too, replacing them (default: skip them)")
    t.add_argument("-r", "--recursive", action="store_true", help="look for media files in subfolders too")
    t.add_argument("--vad-backend", default="auto", choices=("auto", "silero", "energy"),
                   help="speech detector: silero (needs the vad extra), energy, or auto (silero when installed)")
    t.add_argument("--vad-threshold", type=probability, default=None, metavar="P",
                   help="speech probability threshold of the detector (default: its own)")
    t.add_argument("--aligner", default=None, metavar="PATH",
                   help="a Qwen3-ForcedAligner checkpoint (directory or hub id) for word timestamps")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: when stderr is a terminal)")
    add_engine_flags(t)
    from qasr.cli.ray_options import add_transcribe_options  # argparse only: nothing heavy loads

    add_transcribe_options(t)
    b = sub.add_parser("bench", help="throughput benchmark against transformers (needs the test extras)",
                       add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (see qasr bench -h)")
    from qasr.cli.serve import add_serve_parser  # argparse only: nothing heavy loads

    add_serve_parser(sub)
    from qasr.cli.stream import add_stream_parser

    add_stream_parser(sub)
    from qasr.cli.kernels import add_kernels_parser

    add_kernels_parser(sub)
    return parser


# other tools' flags (whisper, faster-whisper, whisper-ctranslate2) -> qasr's, for the hint of an unknown flag
OTHER_SPELLINGS = {
    "--output_format": "-f/--format", "--output_dir": "-o/--output-dir", "--word_timestamps": "--timestamps word",
    "--compute_type": "--dtype or --quantize", "--model_size": "-m/--model", "--model_name": "-m/--model",
    "--model_dir": "-m/--model", "--model_directory": "-m/--model", "--initial_prompt": "--context",
    "--prompt": "--context", "--hotwords": "--context", "--vad_filter": "--segmentation vad",
    "--batch_size": "--max-running", "--verbose": "--progress",
}


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown argument is reported with the subcommand's usage, and an unknown flag
    with the closest flag of the subcommand (other tools' spellings included)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            hints = [f"{flag}: did you mean {hint}?" for flag in extras if (hint := self._closest(flag))]
            self.error("; ".join([f"unrecognized arguments: {' '.join(extras)}", *hints]))
        return namespace, extras

    def _closest(self, flag: str) -> str | None:
        flag = flag.split("=", 1)[0]
        known = self._option_string_actions
        hint = OTHER_SPELLINGS.get(flag) or (flag.replace("_", "-") if flag.startswith("--") else "")
        if hint.split(" ")[0].split("/")[-1] in known:
            return hint
        if not flag.startswith("-"):
            return None
        close = difflib.get_close_matches(flag[2:], [k[2:] for k in known if k.startswith("--")], n=1)
        return "--" + close[0] if close else None


def _formats(text: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise argparse.ArgumentTypeError(f"unknown format {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(FORMATS)}")
    return formats


def _usage_problem(args: argparse.Namespace, inputs: list[str]) -> str | None:
    """What makes this command unrunnable, found before any model is loaded."""
    out = args.output_dir
    if out is not None and out.exists() and not out.is_dir():
        return f"-o {out}: exists and is not a folder"
    if out is None and len(args.format) > 1:
        return "several formats need -o OUT (stdout takes one)"
    if out is None and len(inputs) > 1 and args.format[0] in ("srt", "vtt", "tsv"):
        return f"{args.format[0]} for several inputs needs -o OUT (one file per input)"
    return None


def _model_languages(model: str) -> tuple[str, ...]:
    """The languages a local checkpoint's config.json lists (Qwen3-ASR's for a hub id or a config without)."""
    from qasr.model.config import ModelConfig
    from qasr.model.prompt import SUPPORTED_LANGUAGES

    try:
        listed = ModelConfig.from_file(Path(model).expanduser() / "config.json").support_languages
    except (OSError, ValueError):  # a hub id, or a config the load will refuse with its own message
        listed = ()
    return listed or SUPPORTED_LANGUAGES


def transcribe_command(args: argparse.Namespace) -> int:
    if args.ray is not None and args.threads is not None:
        print("qasr: error: --threads sets this machine's engine; with --ray, --ray-actor-cpus sets each actor's "
              "threads", file=sys.stderr)
        return EXIT_USAGE
    if args.ray is not None:  # inputs may also be URIs of any pyarrow filesystem
        from qasr.distributed.inputs import find_inputs, plan_jobs
    else:
        from qasr.jobs.plan import find_inputs, plan_jobs
    from qasr.jobs.plan import report_failures, update_failed_list

    inputs = find_inputs(args.paths, args.recursive)
    problem = _usage_problem(args, inputs)
    try:  # a bad option fails before the model loads
        model_language(args.language, _model_languages(args.model))
        from_flags(args)
    except ValueError as exc:
        problem = problem or str(exc)
    if problem is not None:
        print(f"qasr: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not inputs:
        print(f"qasr: error: no audio or video files found in {', '.join(args.paths)}", file=sys.stderr)
        return EXIT_FAILED
    aligner = args.aligner
    if aligner is not None and args.timestamps != "word":
        print("qasr: warning: --aligner is used only with --timestamps word; not loading it", file=sys.stderr)
        aligner = None
    jobs = plan_jobs(inputs, args.output_dir)
    todo = jobs if args.overwrite else [job for job in jobs if not job.done(args.format)]
    if len(todo) < len(jobs):
        print(f"qasr: {len(jobs) - len(todo)} of {len(jobs)} inputs already have their outputs; skipping them "
              "(--overwrite redoes them)", file=sys.stderr)
    if not todo:
        update_failed_list(args.output_dir, [])
        return 0
    if args.ray is not None:
        from qasr.distributed.commands import run_on_ray

        return run_on_ray(todo, args, total_inputs=len(jobs))
    # a URL is not a missing file: the run reports it with its own message (URLs are not fetched)
    missing = [job.source for job in todo if not os.path.exists(job.source) and "://" not in job.source]
    if len(missing) == len(todo):  # nothing to transcribe: say so now rather than after loading the model
        failures = [(source, f"{source}: file not found") for source in missing]
        for _, message in failures:
            print(f"qasr: error: {message}", file=sys.stderr)
        report_failures(args.output_dir, failures, len(jobs))
        return EXIT_FAILED

    try:
        asr = load_asr(args, aligner)
        core = asr._core
        core.canonical_language(args.language)
    except (ValueError, FileNotFoundError) as exc:
        print(f"qasr: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from qasr.jobs.runner import run_jobs

    try:
        return run_jobs(asr, todo, args, total_inputs=len(jobs))
    finally:
        # stop the engine threads before the interpreter exits: one left inside a native kernel aborts it
        core.engine.close(drain=False, timeout=30)
        if core.aligner is not None:
            core.aligner.engine.close(drain=False, timeout=30)


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
        from qasr.bench.main import main as bench_main

        return bench_main(argv[1:])
    from qasr.cli.ray_options import split_ray_address

    args = build_parser().parse_args(split_ray_address(argv))
    if args.command == "serve":
        from qasr.cli.serve import serve_command

        return serve_command(args)
    if args.command == "stream":
        from qasr.cli.stream import stream_command

        return stream_command(args)
    _log_to_stderr()
    if args.command not in ("transcribe", "kernels"):
        return EXIT_USAGE
    # SIGTERM (a scheduler or `kill`) stops like Ctrl-C: cancel the work, keep only complete outputs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.command == "kernels":
            from qasr.cli.kernels import kernels_command

            return kernels_command(args)
        return transcribe_command(args)
    except KeyboardInterrupt:  # during a model load or a kernel build (run_jobs reports its own)
        print("qasr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())
