"""Running a planned transcription job: results to files (or stdout), progress, failures, interruption.

Each input's outputs are written the moment its last segment finishes, so an interruption loses only
the inputs still in flight, and their outputs never exist half-written (``write_atomic``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from qasr.jobs.plan import Job, probe_duration, report_failures, update_failed_list
from qasr.outputs.writers import render, write_atomic
from qasr.results import Transcription
from qasr.transcribe.asr import ASR

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


class Progress:
    """A bar in audio seconds with files done, ETA and RTFx (audio seconds per wall second)."""

    def __init__(self, total_s: float, files: int, enabled: bool) -> None:
        self.files, self.files_done, self.audio_done = files, 0, 0.0
        self.started = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=round(total_s, 1) or None, unit="s", file=sys.stderr, dynamic_ncols=True,
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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_jobs(asr: ASR, jobs: list[Job], args: argparse.Namespace, total_inputs: int) -> int:
    """Transcribe ``jobs``, write their outputs, list failures; returns the exit status."""
    to_files = args.output_dir is not None
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    total_s = sum(d for d in (probe_duration(j.source) for j in jobs) if d) if enabled else 0.0
    progress = Progress(total_s, len(jobs), enabled)
    emit = _file_writer(args.format) if to_files else _stdout_writer(args.format[0], several=total_inputs > 1)
    failures: list[tuple[str, str]] = []
    finished = 0
    vad = _vad_config(args)
    try:
        results = asr.transcribe_iter([j.source for j in jobs], language=args.language, context=args.context,
                                      max_new_tokens=args.max_new_tokens, progress=progress.audio,
                                      segmentation=args.segmentation, max_segment_s=args.max_segment_s,
                                      timestamps=args.timestamps, **vad)
        try:
            for i, result in results:
                if result.error is not None:
                    failures.append((jobs[i].source, result.error))
                    print(f"qasr: error: {result.error}", file=sys.stderr)
                emit(i, jobs[i], result)
                finished += 1
                progress.file_done()
        finally:
            results.close()  # on any way out: cancel what is still running
    except KeyboardInterrupt:
        progress.close()
        update_failed_list(args.output_dir, failures)
        print(f"qasr: interrupted: {finished} of {len(jobs)} inputs finished"
              + ("; run the same command again to do the rest" if to_files else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout.flush()
    progress.close()
    report_failures(args.output_dir, failures, len(jobs))
    return EXIT_FAILED if failures else EXIT_OK


def _vad_config(args: argparse.Namespace) -> dict:
    """The detector settings the command line asked for, as ``transcribe``'s ``vad`` argument."""
    if args.vad_backend == "auto" and args.vad_threshold is None:
        return {}
    from qasr.audio.vad import VadConfig

    fields = {"backend": args.vad_backend}
    if args.vad_threshold is not None:
        fields["threshold"] = args.vad_threshold
    return {"vad": VadConfig(**fields)}


def _file_writer(formats: tuple[str, ...]) -> Callable[[int, Job, Transcription], None]:
    def emit(_: int, job: Job, result: Transcription) -> None:
        if result.error is None:
            for fmt in formats:
                write_atomic(job.output(fmt), render(result, fmt))
    return emit


def _stdout_writer(fmt: str, several: bool) -> Callable[[int, Job, Transcription], None]:
    """Print results in input order (results arrive in completion order): JSON Lines for json, and
    text lines prefixed by their input when there are several inputs."""
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
        while next_index[0] in waiting:
            ready = waiting.pop(next_index[0])
            next_index[0] += 1
            if ready.error is None or fmt == "json":  # JSON Lines keeps one line per input, errors included
                sys.stdout.write(show(ready))
        sys.stdout.flush()
    return emit
