"""Word timestamps from ``qasr serve --aligner``: the demo model with a tiny random forced aligner.

A random aligner's times are meaningless but follow the rules the server promises: one word per word of
the transcript, spelled as in it, inside their segment, in order; OpenAI's top-level ``words`` list. The
choices made before any work (refusals) and the answer shapes are checked without a server.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import srt
from server_proc import ServerProcess
from starlette.datastructures import FormData, UploadFile

from qasr.results import Segment, Transcription, Word
from qasr.server.errors import ApiError
from qasr.server.params import parse_params
from qasr.server.responses import verbose_json
from qasr.server.work import Finished
from qasr.testing.checkpoint import make_tiny_aligner_checkpoint
from qasr.testing.speech import speak


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    """Two sentences 2 s apart, four times (~35 s): more than one VAD segment (each at most 30 s)."""
    d = tmp_path_factory.mktemp("words_audio")
    parts = []
    for k, sentence in enumerate(("set an alarm for six forty five", "call anna on the ninth of july")):
        wave, sr = sf.read(speak(sentence, d / f"s{k}.wav"), dtype="float32")
        parts += [wave, np.zeros(sr * 2, np.float32)]
    sf.write(d / "two.wav", np.concatenate(parts * 4), sr)
    return (d / "two.wav").read_bytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    aligner = make_tiny_aligner_checkpoint(tmp_path_factory.mktemp("aligner") / "tiny", seed=1)
    with ServerProcess(tmp_path_factory.mktemp("server_words") / "serve.log", "--aligner", str(aligner)) as srv:
        yield srv


def post(server: ServerProcess, clip: bytes, **data: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": ("two.wav", clip)}, data=data,
                      timeout=120)


def test_verbose_json_words_match_the_transcript_and_lie_in_segments(server, clip) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    v = client.audio.transcriptions.create(model="m", file=("two.wav", clip), response_format="verbose_json",
                                           timestamp_granularities=["word", "segment"], chunking_strategy="auto")
    assert v.text and len(v.segments) >= 2
    assert [w.word for w in v.words] == v.text.split()
    starts = [w.start for w in v.words]
    assert starts == sorted(starts)
    # each segment's words are its own text's, and their times lie inside it
    k = 0
    for s in v.segments:
        mine = v.words[k:k + len(s.text.split())]
        k += len(mine)
        assert [w.word for w in mine] == s.text.split()
        assert all(s.start <= w.start <= w.end <= s.end for w in mine)
    assert k == len(v.words)


def test_word_only_omits_segments_and_srt_cues_follow_word_times(server, clip) -> None:
    body = post(server, clip, response_format="verbose_json", **{"timestamp_granularities[]": "word"}).json()
    assert "segments" not in body and [w["word"] for w in body["words"]] == body["text"].split()
    assert set(body["words"][0]) == {"word", "start", "end", "probability"}  # probability: faster-whisper's key
    assert all(0 < w["probability"] <= 1 for w in body["words"])
    plain = post(server, clip, response_format="verbose_json").json()  # the default granularity: segments only
    assert "words" not in plain and plain["segments"] and plain["text"] == body["text"]
    cues = list(srt.parse(post(server, clip, response_format="srt",
                               **{"timestamp_granularities[]": "word"}).text))
    starts = {round(w["start"], 3) for w in body["words"]}
    assert cues and all(round(c.start.total_seconds(), 3) in starts for c in cues)


def test_models_report_word_timestamps(server) -> None:
    [model, *_] = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert model["word_timestamps"] is True and "English" in model["word_timestamp_languages"]


# ---------------------------------------------------------------- without a server


def _form(**fields: str) -> FormData:
    return FormData([("file", UploadFile(file=None, filename="a.wav")), *fields.items()])  # type: ignore[arg-type]


def _asr(aligner_languages: tuple[str, ...] | None) -> SimpleNamespace:
    aligner = None if aligner_languages is None else SimpleNamespace(supported_languages=aligner_languages)
    return SimpleNamespace(aligner=aligner, canonical_language=lambda lang: {"en": "English"}.get(lang, lang))


def test_word_requests_are_refused_before_any_work() -> None:
    word = {"response_format": "verbose_json", "timestamp_granularities[]": "word"}
    with pytest.raises(ApiError, match="need an aligner"):
        parse_params(_form(**word), _asr(None))
    with pytest.raises(ApiError, match="not supported by the forced aligner") as info:
        parse_params(_form(language="en", **word), _asr(("Chinese",)))
    assert info.value.param == "language"
    p = parse_params(_form(**word), _asr(("Chinese",)))  # detected: only known after transcribing
    assert p.words and not p.segments
    p = parse_params(_form(response_format="json", **{"timestamp_granularities[]": "word"}), _asr(("English",)))
    assert not p.words  # json has no place for word times: no alignment work
    p = parse_params(_form(language="en", response_format="text", **{"timestamp_granularities[]": "word"}),
                     _asr(("Chinese",)))
    assert not p.words  # nor a refusal for the aligner's languages then


def test_untimed_words_give_segments_instead() -> None:
    seg = Segment(0.0, 1.0, "hi there", words=(Word("hi", 0.1, 0.3), Word("there", 0.4, 0.9)))
    done = Finished(Transcription("hi there", "English", 1.0, segments=(seg,), timestamps="word"),
                    ((1, 2),), input_tokens=10, audio_tokens=5, output_tokens=2, ttft_s=None)
    body = verbose_json(done, words=True, segments=False)
    assert body["words"] == [{"word": "hi", "start": 0.1, "end": 0.3, "probability": None},
                             {"word": "there", "start": 0.4, "end": 0.9, "probability": None}]
    assert "segments" not in body
    # a language the aligner does not cover (detected): no words, and segment times whatever was asked
    untimed = Finished(Transcription("hi there", "English", 1.0, segments=(Segment(0.0, 1.0, "hi there"),)),
                       ((1, 2),), input_tokens=10, audio_tokens=5, output_tokens=2, ttft_s=None)
    body = verbose_json(untimed, words=True, segments=False)
    assert "words" not in body and body["segments"][0]["start"] == 0.0


def test_page_shows_word_times(server, clip, tmp_path) -> None:
    """The page's "word timestamps" box: enabled for verbose_json once /v1/models says the server has an
    aligner; the answer then starts with one line per word."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs chromium and chromedriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.wait import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    (tmp_path / "two.wav").write_bytes(clip)
    browser = webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)
    try:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        box = browser.find_element(By.ID, "words")
        assert not box.is_enabled()  # the default format, streamed text, has no word times
        Select(browser.find_element(By.ID, "format")).select_by_value("verbose_json")
        wait.until(lambda d: d.find_element(By.ID, "words").is_enabled())
        box.click()
        browser.find_element(By.ID, "file").send_keys(str(tmp_path / "two.wav"))
        browser.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith(("Done", "4", "5", "Request")))
        assert browser.find_element(By.ID, "status").text.startswith("Done")
        lines = browser.find_element(By.ID, "transcript").text.split("\n")
        first = lines[0].split()
        assert len(first) == 3 and float(first[0]) <= float(first[1]) and first[2] == "set"
        assert '"words": [' in browser.find_element(By.ID, "transcript").text
    finally:
        browser.quit()
