"""``qasr transcribe --ray`` on a local Ray runtime (2 CPUs, a small object store), against the single-process
command on the same folder: 40 inputs (35 short clips in four containers, same-stem pairs, a 90 s recording
with pauses that the VAD cuts into several segments, 40 s of silence, a corrupt file).

Covers: outputs byte-identical to the single-process run through 2 actors; an actor killed for good
(``ray.kill``) mid-job, with its lost segments redone in a second pass and every output written once;
an interrupted job (SIGINT) resumed without redoing finished inputs; folder URIs (pyarrow's file://);
usage errors. Marked ``ray``: ``make test-ray`` runs these, ``make test`` leaves them out.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from server_proc import qasr_command

from qasr.testing.speech import convert, speak

ray = pytest.importorskip("ray")
# Ray and Ray Serve warn about their own deprecated internals (pydantic fields, DataContext options)
pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ("-m", str(ROOT / "models" / "qasr-demo-en"), "--device", "cpu", "--dtype", "float32", "--no-progress")
FORMATS = ("-f", "json,srt,txt")
# two actors of half a core each and half-core decode tasks: all of it fits the 2-CPU runtime at once
POOL = ("--ray-actors", "2", "--ray-actor-cpus", "0.5", "--ray-decode-cpus", "0.5", "--ray-batch", "4")
SENTENCES = ("set an alarm for six", "call anna tomorrow", "turn off the lights", "what is the weather",
             "play some music", "remind me at nine")


@pytest.fixture(scope="module")
def runtime():
    """A local Ray runtime for this module; its address lets subprocesses join it."""
    ray.init(num_cpus=2, object_store_memory=200 * 10**6, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray_job") / "in"
    for sub in ("a", "b", "c"):
        (root / sub).mkdir(parents=True)
    tmp = root / "tmp.wav"
    for k in range(35):  # 35 clips: wav, and every fifth one flac / mp3 / ogg
        target = root / ("a" if k < 17 else "b") / f"clip{k:02d}.wav"
        speak(SENTENCES[k % len(SENTENCES)], tmp, speed=130 + 4 * k)
        if k % 5 == 1:
            convert(tmp, target.with_suffix((".flac", ".mp3", ".ogg")[k // 5 % 3]))
        else:
            tmp.replace(target)
    speak("set a timer for ten minutes", root / "c" / "same.wav")
    convert(speak("call anna on the ninth of july", tmp), root / "c" / "same.flac")  # same stem
    parts = []
    for k, sentence in enumerate(SENTENCES * 3):
        wave, sr = sf.read(speak(sentence, tmp, speed=150), dtype="float32")
        parts += [wave, np.zeros(int(sr * (1.0 + k % 4)), np.float32)]
    sf.write(tmp, np.concatenate(parts * 2), sr)  # about 90 s: several VAD segments, spread over actors
    convert(tmp, root / "c" / "long.mp3")
    tmp.unlink()
    sf.write(root / "c" / "silence.wav", np.zeros(16000 * 40, np.float32), 16000)
    (root / "c" / "corrupt.mp3").write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    assert len(list(root.rglob("*.*"))) == 40
    return root


def qasr(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qasr", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def outputs(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory) -> dict[str, str]:
    """The single-process command's outputs for the folder."""
    out = tmp_path_factory.mktemp("reference")
    done = qasr("transcribe", str(folder), "-r", "-o", str(out), *FORMATS, *MODEL)
    assert done.returncode == 1, done.stderr  # the corrupt file
    got = outputs(out)
    assert len([n for n in got if n.endswith(".json")]) == 39 and "failed.tsv" in got
    long = [s for s in got["c/long.srt"].split("\n\n") if s.strip()]
    assert len(long) > 3, "the long file should give several segments"
    return got


def run_in_process(args: list[str], capfd) -> tuple[int, str]:  # noqa: ANN001
    """The command run in this process, on this module's Ray runtime: ``(exit status, stderr)``."""
    from qasr.cli.main import main

    code = main(args)
    return code, capfd.readouterr().err


def test_forty_files_through_two_actors_match_the_single_process_run(runtime, folder, reference, tmp_path,
                                                                     capfd) -> None:
    out = tmp_path / "out"
    code, err = run_in_process(["transcribe", "--ray", runtime, str(folder), "-r", "-o", str(out), *FORMATS,
                                *MODEL, *POOL], capfd)
    assert code == 1, err
    assert "40 inputs, 2 ASR actors" in err and "1 pass, 0 segments redone" in err, err
    assert outputs(out) == reference
    assert not [p for p in out.rglob("*") if p.name.startswith(".")], "temporary files left behind"


def test_an_actor_killed_mid_job_loses_and_repeats_nothing(runtime, folder, reference, tmp_path, capfd,
                                                           monkeypatch) -> None:
    import qasr.jobs.runner

    out = tmp_path / "out"
    writes: Counter[str] = Counter()
    write = qasr.jobs.runner.write_atomic

    def counted(path: Path, text: str) -> None:
        writes[str(path.relative_to(out))] += 1
        write(path, text)

    monkeypatch.setattr(qasr.jobs.runner, "write_atomic", counted)
    killed: list[str] = []

    def asr_actors() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("qasr-asr-")}

    earlier = asr_actors()  # an earlier test's actors may still be on their way out

    def kill_one_actor_once_outputs_appear() -> None:
        deadline = time.monotonic() + 300
        while not writes and time.monotonic() < deadline:
            time.sleep(0.01)
        names = sorted(asr_actors() - earlier)
        handles = [ray.get_actor(name) for name in names]
        # both loaded their model (one may still be loading when the other's first results are written):
        # from then on segments wait for them both, so the one killed holds calls in flight
        ray.get([h.__ray_ready__.remote() for h in handles], timeout=300)
        time.sleep(0.2)
        if len(names) == 2 and len(writes) < 3 * 30:  # 3 outputs an input: at least 10 inputs still to do
            ray.kill(handles[0])  # for good: no restart, its calls in flight are lost
            killed.append(names[0])

    killer = threading.Thread(target=kill_one_actor_once_outputs_appear, daemon=True)
    killer.start()
    # engines decoding one segment at a time: segments queue up for the actors, so both are always busy
    code, err = run_in_process(["transcribe", "--ray", runtime, str(folder), "-r", "-o", str(out), *FORMATS,
                                *MODEL, *POOL, "--max-running", "1"], capfd)
    killer.join(10)
    assert killed and code == 1, err
    redone = re.search(r"(\d+) pass(?:es)?, (\d+) segments redone", err)
    assert redone and int(redone[1]) == 2 and int(redone[2]) > 0, f"the kill took no segment with it:\n{err}"
    assert outputs(out) == reference  # nothing lost
    assert set(writes.values()) == {1}, "an output was written twice"  # nothing repeated
    assert len(writes) == len(reference) - 1  # every output but failed.tsv, which update_failed_list writes


def test_an_interrupted_job_resumes_without_redoing_finished_inputs(runtime, folder, reference, tmp_path) -> None:
    out = tmp_path / "out"
    # one actor working one segment at a time: the job is still busy when the first outputs appear
    slow = ("--ray-actors", "1", "--ray-actor-cpus", "0.5", "--ray-decode-cpus", "0.5", "--ray-batch", "1",
            "--max-running", "1")
    proc = subprocess.Popen(qasr_command("transcribe", "--ray", runtime, str(folder), "-r", "-o",
                                         str(out), *FORMATS, *MODEL, *slow),
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list(out.rglob("*.txt"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    first = outputs(out)
    finished = {n.rsplit(".", 1)[0] for n in first if n.endswith(".txt")}
    assert 2 <= len(finished) < 39
    assert not [p for p in out.rglob("*") if p.name.startswith(".")], "temporary files left behind"
    for name, text in first.items():  # whatever exists is complete and as the single-process run wrote it
        if name != "failed.tsv":
            assert text == reference[name], name
    stamps = {name: (out / name).stat().st_mtime_ns for name in first}

    again = qasr("transcribe", "--ray", runtime, str(folder), "-r", "-o", str(out), *FORMATS, *MODEL, *POOL)
    assert again.returncode == 1, again.stderr
    skipped = re.search(r"(\d+) of 40 inputs already have their outputs; skipping them", again.stderr)
    assert skipped and int(skipped[1]) == len(finished), again.stderr
    assert f"{40 - len(finished)} inputs, 2 ASR actors" in again.stderr
    assert outputs(out) == reference
    for name, stamp in stamps.items():  # finished inputs were not redone
        # (an input interrupted between its formats' files has some of them: it is not done, and is redone)
        if name != "failed.tsv" and name.rsplit(".", 1)[0] in finished:
            assert (out / name).stat().st_mtime_ns == stamp, name


def test_folder_uris_list_and_name_outputs_like_local_folders(runtime, folder, reference, tmp_path, capfd) -> None:
    out = tmp_path / "out"
    code, err = run_in_process(["transcribe", "--ray", runtime, f"file://{folder / 'c'}", "-o", str(out), *FORMATS,
                                *MODEL, *POOL], capfd)
    assert code == 1, err  # c/corrupt.mp3
    got = outputs(out)
    assert {n for n in got if n != "failed.tsv"} == {n[2:] for n in reference if n.startswith("c/")}
    for name, text in got.items():
        if name.endswith((".txt", ".srt")):
            assert text == reference[f"c/{name}"], name
    failed = got["failed.tsv"].splitlines()
    assert len(failed) == 2 and failed[1].startswith(f"file://{folder / 'c' / 'corrupt.mp3'}\t")


def test_usage_errors_and_a_missing_ray(folder, tmp_path) -> None:
    clip = str(folder / "a" / "clip00.wav")
    missing = qasr("transcribe", "--ray", clip, "-m", str(tmp_path / "nothing"), "-o", str(tmp_path / "o"))
    assert missing.returncode == 2 and "no such checkpoint directory" in missing.stderr, missing.stderr
    code = ("import sys; sys.modules['ray'] = None\nfrom qasr.cli.main import main\n"
            f"sys.exit(main(['transcribe', '--ray', {clip!r}, '-o', {str(tmp_path / 'o')!r}, "
            f"'-m', {MODEL[1]!r}]))")
    no_ray = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert no_ray.returncode == 2 and "pip install 'qasr[ray]'" in no_ray.stderr, no_ray.stderr
    assert "Traceback" not in no_ray.stderr


def test_ray_address_or_input() -> None:
    from qasr.cli.ray_options import is_ray_address, split_ray_address

    assert [is_ray_address(a) for a in ("auto", "local", "ray://head:10001", "10.0.0.5:6379", "in/", "s3://b/x")] \
        == [True, True, True, True, False, False]
    assert split_ray_address(["transcribe", "--ray", "in/", "-o", "out"]) == ["transcribe", "--ray=", "in/", "-o",
                                                                               "out"]
    assert split_ray_address(["transcribe", "--ray", "auto", "in/"]) == ["transcribe", "--ray", "auto", "in/"]
    assert os.path.exists(ROOT / "models") and not is_ray_address(str(ROOT / "models"))
