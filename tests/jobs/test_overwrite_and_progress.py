"""A rerun into the same ``-o``: outputs that exist are kept and the skip says how to redo them; ``--overwrite``
redoes them. The progress bar ends full."""

from __future__ import annotations

from server_proc import ALARM, DEMO_ARGS, run_qasr

from qasr.jobs.runner import Progress

WHOLE = "set an alarm for seven thirty tomorrow\n"



def test_a_rerun_keeps_outputs_unless_overwrite(tmp_path) -> None:
    cut = run_qasr("transcribe", ALARM, *DEMO_ARGS, "-o", str(tmp_path), "--max-new-tokens", "2")
    assert cut.returncode == 0, cut.stderr
    first = (tmp_path / "alarm.txt").read_text()
    assert first != WHOLE
    again = run_qasr("transcribe", ALARM, *DEMO_ARGS, "-o", str(tmp_path))  # other options: the outputs exist
    assert again.returncode == 0, again.stderr
    assert again.stderr == ("qasr: 1 of 1 inputs already have their outputs; skipping them "
                            "(--overwrite redoes them)\n")
    assert (tmp_path / "alarm.txt").read_text() == first
    redone = run_qasr("transcribe", ALARM, *DEMO_ARGS, "-o", str(tmp_path), "--overwrite")
    assert redone.returncode == 0 and redone.stderr == "", redone.stderr
    assert (tmp_path / "alarm.txt").read_text() == WHOLE


def _bars(err: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if "s of audio" in line]


def test_the_bar_ends_full_when_the_header_and_the_audio_differ(capsys) -> None:
    progress = Progress(2.357375, 1, enabled=True)  # the header's duration of alarm.flac
    progress.audio(2.35)  # what was decoded
    progress.file_done()
    progress.close(complete=True)
    last = _bars(capsys.readouterr().err)[-1]
    assert last.startswith("100%|") and set(last.split("|")[1]) == {"█"}, last


def test_an_interrupted_bar_stays_where_it_was(capsys) -> None:
    progress = Progress(10.0, 2, enabled=True)
    progress.audio(5.0)
    progress.close()
    assert _bars(capsys.readouterr().err)[-1].startswith(" 50%|")


def test_the_commands_bar_ends_full(tmp_path) -> None:
    out = run_qasr("transcribe", ALARM, *DEMO_ARGS[:-1], "--progress", "-o", str(tmp_path))
    assert out.returncode == 0, out.stderr
    last = _bars(out.stderr)[-1]
    assert last.startswith("100%|") and set(last.split("|")[1]) == {"█"} and "1/1 files" in last, last
