"""Running planned jobs: each input's outputs written once it finishes, progress, failures, interruption."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from qasr.audio.probe import header_duration
from qasr.jobs.plan import Job, report_failures, update_failed_list
from qasr.outputs.writers import render, write_atomic
from qasr.results import Segment, Transcription
from qasr.transcribe.asr import ASR
from qasr.transcribe.options import from_flags
from qasr.transcribe.text import TextJoiner

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


class Progress:
    """A bar in audio seconds with files done, ETA and RTFx."""

    def __init__(self, total_s: float, files: int, enabled: bool) -> None:
        self.files, self.files_done, self.audio_done = files, 0, 0.0
        self.started = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_s or None, unit="s", file=sys.stderr, dynamic_ncols=True,
                            bar_format="{percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of audio "
                                       "[{elapsed}<{remaining}{postfix}]")
            self._show()

    def audio(self, seconds: float) -> None:
        self.audio_done += seconds
        if self.bar is not None:
            self.bar.update(seconds)
            self._show()

    def file_done(self) -> None:
        self.files_done += 1
        if self.bar is not None:
            self._show()

    def rtfx(self) -> float:
        return self.audio_done / max(time.perf_counter() - self.started, 1e-9)

    def _show(self) -> None:
        assert self.bar is not None
        self.bar.set_postfix_str(f"{self.files_done}/{self.files} files, RTFx {self.rtfx():.1f}", refresh=True)

    def close(self, complete: bool = False) -> None:
        """``complete``: every input is done, so the bar ends full (decoded lengths differ from headers')."""
        if self.bar is not None:
            if complete and self.bar.total:
                self.bar.n = self.bar.total
                self._show()
            self.bar.close()


def run_jobs(asr: ASR, jobs: list[Job], args: argparse.Namespace, total_inputs: int) -> int:
    """Transcribe ``jobs``, write their outputs, list failures; returns the exit status."""
    to_files = args.output_dir is not None
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    total_s = sum(d for d in (header_duration(j.source) for j in jobs) if d) if enabled else 0.0
    progress = Progress(total_s, len(jobs), enabled)
    partial = PartialText(jobs, to_files) if "txt" in args.format and (to_files or total_inputs == 1) else None
    emit = _file_writer(args.format) if to_files else _stdout_writer(args.format[0], several=total_inputs > 1,
                                                                      partial=partial)
    failures: list[tuple[str, str]] = []
    finished = 0
    try:
        results = asr.transcribe_iter([j.source for j in jobs], from_flags(args), progress=progress.audio,
                                      segments=partial is not None)
        try:
            for i, result in results:
                if isinstance(result, Segment):
                    partial.add(i, result)  # type: ignore[union-attr]
                    continue
                if partial is not None:
                    partial.end(i)
                if result.error is not None:
                    failures.append((jobs[i].source, result.error))
                    print(f"qasr: error: {result.error}", file=sys.stderr)
                emit(i, jobs[i], result)
                finished += 1
                progress.file_done()
        finally:
            results.close()  # cancels what still runs
            if partial is not None:
                partial.close()
    except KeyboardInterrupt:
        progress.close()
        update_failed_list(args.output_dir, failures)
        print(f"qasr: interrupted: {finished} of {len(jobs)} inputs finished"
              + ("; run the same command again to do the rest" if to_files else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout.flush()
    progress.close(complete=True)
    report_failures(args.output_dir, failures, len(jobs))
    return EXIT_FAILED if failures else EXIT_OK


class PartialText:
    """Segments' text as it comes, to ``NAME.txt.partial`` beside a txt output (removed when the input ends)
    or, for one input printed as txt, to stdout."""

    def __init__(self, jobs: list[Job], to_files: bool) -> None:
        self.jobs = jobs
        self.to_files = to_files
        self.joiners: dict[int, TextJoiner] = {}
        self.open: dict[int, Path] = {}

    def add(self, i: int, segment: Segment) -> None:
        delta = self.joiners.setdefault(i, TextJoiner()).add(segment.text)
        if not delta:
            return
        if not self.to_files:
            sys.stdout.write(delta)
            sys.stdout.flush()
            return
        path = self.open.get(i)
        mode = "a"
        if path is None:
            path = self.open[i] = self.jobs[i].output("txt").with_name(self.jobs[i].output("txt").name + ".partial")
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = "w"  # a stale one is replaced
        with open(path, mode, encoding="utf-8") as f:
            f.write(delta)

    def printed(self, i: int) -> str:
        joiner = self.joiners.get(i)
        return joiner.text if joiner is not None else ""

    def end(self, i: int) -> None:
        path = self.open.pop(i, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for i in list(self.open):
            self.end(i)


def _file_writer(formats: tuple[str, ...]) -> Callable[[int, Job, Transcription], None]:
    def emit(_: int, job: Job, result: Transcription) -> None:
        if result.error is None:
            for fmt in formats:
                write_atomic(job.output(fmt), render(result, fmt))
    return emit


def _stdout_writer(fmt: str, several: bool, partial: PartialText | None) -> Callable[[int, Job, Transcription], None]:
    """Results in input order: JSON Lines for json, text prefixed by the input when several; what
    ``partial`` printed is not printed again."""
    waiting: dict[int, Transcription] = {}
    next_index = [0]

    def show(result: Transcription) -> str:
        if fmt == "json":
            return render(result, "json", compact=True)
        if fmt == "txt" and several:
            return f"{result.source}: {result.text}\n"
        return render(result, fmt)

    def emit(i: int, _: Job, result: Transcription) -> None:
        waiting[i] = result
        while (k := next_index[0]) in waiting:
            ready = waiting.pop(k)
            next_index[0] += 1
            shown = partial.printed(k) if partial is not None else ""
            if ready.error is None or fmt == "json":  # one JSON line per input, errors too
                text = show(ready)
                assert text.startswith(shown), "the streamed text is the start of the whole"
                sys.stdout.write(text[len(shown):])
            elif shown:
                sys.stdout.write("\n")  # ends the failed input's line
        sys.stdout.flush()
    return emit
