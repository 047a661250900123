"""``qasr serve`` over real HTTP: one server subprocess on the demo model, the official openai client and
raw httpx. Covers every response format, streaming (event shapes, same text as plain), concurrent requests
against offline transcription, malformed and oversized uploads, languages, the API key, client disconnects
(plain and streamed) freeing the engine, the queue limit (429), metrics and the page."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import srt
import webvtt
from server_proc import DEMO_MODEL, ServerProcess, metric

from qasr.testing.speech import convert, speak

KEY = "test-key-123"
SENTENCES = ("set an alarm for six forty five", "call anna on the ninth of july", "turn off the lights",
             "what is the weather", "play some music", "remind me at nine")
QUEUE_LIMIT_S = 80  # the long clip (~90 s) alone is admitted into an empty queue; anything beside it is not


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("server_audio")
    out = {f"s{k}": speak(s, d / f"s{k}.wav", speed=150 + 7 * k) for k, s in enumerate(SENTENCES)}
    out["flac"] = convert(out["s1"], d / "s1.flac")
    parts = []
    for k in range(30):  # ~90 s of speech with pauses: many VAD segments, a long stream
        wave, sr = sf.read(out[f"s{k % 6}"], dtype="float32")
        parts += [wave, np.zeros(int(sr * 0.8), np.float32)]
    sf.write(d / "long.wav", np.concatenate(parts), sr)
    out["long"] = convert(d / "long.wav", d / "long.flac")  # fits under --max-upload-mb
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("server") / "serve.log", "--max-upload-mb", "3",
                      "--max-queue-audio-s", str(QUEUE_LIMIT_S), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(clips):
    from qasr import ASR

    asr = ASR.from_pretrained(DEMO_MODEL, device="cpu", dtype="float32")
    texts = {name: r.text for name, r in zip(clips, asr.transcribe([str(p) for p in clips.values()]), strict=True)}
    asr._core.engine.close(drain=False, timeout=30)
    return texts


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server: ServerProcess, files=None, data=None, headers=None, timeout: float = 60, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/transcriptions", files=files, data=data,
                      headers=server.headers if headers is None else headers, timeout=timeout, **kwargs)


def assert_error(response: httpx.Response, status: int, needle: str, param: str | None = "__any__") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error
    if param != "__any__":
        assert error["param"] == param
    return error


def test_every_response_format(server, client, clips, offline) -> None:
    expected = offline["s0"]
    assert expected == "set an alarm for six forty five"
    with open(clips["s0"], "rb") as f:
        r = client.audio.transcriptions.create(model="whatever", file=f)
    assert r.text == expected
    raw = post(server, files={"file": open(clips["s0"], "rb")}, data={"model": "m"}).json()
    assert raw["language"] == "English" and raw["usage"]["type"] == "duration"
    assert raw["usage"]["seconds"] == pytest.approx(sf.info(clips["s0"]).duration, abs=1e-3)
    with open(clips["flac"], "rb") as f:
        assert client.audio.transcriptions.create(model="m", file=f, response_format="text").strip() == offline["flac"]
    with open(clips["s0"], "rb") as f:
        subs = list(srt.parse(client.audio.transcriptions.create(model="m", file=f, response_format="srt")))
    assert " ".join(s.content.replace("\n", " ") for s in subs) == expected
    with open(clips["s0"], "rb") as f:
        vtt = client.audio.transcriptions.create(model="m", file=f, response_format="vtt")
    assert vtt.startswith("WEBVTT")
    assert " ".join(c.text.replace("\n", " ") for c in webvtt.from_string(vtt)) == expected
    with open(clips["long"], "rb") as f:
        v = client.audio.transcriptions.create(model="m", file=f, response_format="verbose_json",
                                               timestamp_granularities=["segment"], language="en", temperature=0.4)
    assert v.text == offline["long"] and v.language == "English" and v.duration == pytest.approx(
        sf.info(clips["long"]).duration, abs=1e-3)
    assert len(v.segments) > 3 and [s.id for s in v.segments] == list(range(len(v.segments)))
    for s in v.segments:
        assert s.start < s.end and s.seek == round(s.start * 100) and s.tokens and s.temperature == 0.0
        assert s.avg_logprob <= 0 and s.no_speech_prob is None and s.compression_ratio > 0
    starts = [s.start for s in v.segments]
    assert starts == sorted(starts)


def _sse(response: httpx.Response) -> list[dict]:
    """Parse the raw SSE body strictly: only `data:` lines, each event ended by a blank line."""
    body = response.text
    assert body.endswith("\n\n")
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(json.loads(block[len("data: "):]))
    return events


@pytest.mark.parametrize("language", [None, "en"])
def test_streaming_equals_plain_text(server, client, clips, offline, language) -> None:
    extra = {"language": language} if language else {}
    for name in ("s1", "long"):
        r = post(server, files={"file": open(clips[name], "rb")}, data={"stream": "true", **extra})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
        *deltas, done = events
        assert deltas and all(set(e) == {"type", "delta"} and e["type"] == "transcript.text.delta" for e in deltas)
        assert done["type"] == "transcript.text.done" and set(done) == {"type", "text", "usage"}
        assert set(done["usage"]) == {"type", "input_tokens", "output_tokens", "total_tokens", "input_token_details"}
        streamed = "".join(e["delta"] for e in deltas)
        assert "<asr_text>" not in streamed and "language" not in streamed
        plain = post(server, files={"file": open(clips[name], "rb")}, data=extra).json()["text"]
        assert streamed == done["text"] == plain == offline[name]
    with open(clips["s2"], "rb") as f:  # the official client's stream parser agrees
        events = list(client.audio.transcriptions.create(model="m", file=f, stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == offline["s2"]
    assert events[-1].usage.total_tokens == events[-1].usage.input_tokens + events[-1].usage.output_tokens


def test_verbose_json_stream_sends_each_segment_in_order(server, client, clips) -> None:
    """With response_format=verbose_json a stream also carries ``transcript.text.segment`` events: one per
    segment, in time order, each right after its text's deltas, equal to the plain answer's segments."""
    r = post(server, files={"file": open(clips["long"], "rb")},
             data={"stream": "true", "response_format": "verbose_json"})
    assert r.status_code == 200
    blocks = r.text[:-2].split("\n\n")
    named = [b.split("\n", 1) for b in blocks if b.startswith("event: ")]
    assert named and all(head == "event: transcript.text.segment" for head, _ in named)
    events = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    segments = [e for e in events if e["type"] == "transcript.text.segment"]
    plain = post(server, files={"file": open(clips["long"], "rb")}, data={"response_format": "verbose_json"}).json()
    assert len(segments) == len(plain["segments"]) > 2
    assert [(e["start"], e["end"], e["text"]) for e in segments] == \
        [(s["start"], s["end"], s["text"]) for s in plain["segments"]]
    assert [e["id"] for e in segments] == [f"seg_{k:03d}" for k in range(len(segments))]
    text = ""  # each segment event comes once the deltas before it spell out its text
    for e in events:
        if e["type"] == "transcript.text.delta":
            text += e["delta"]
        elif e["type"] == "transcript.text.segment":
            assert text.endswith(e["text"]), (text[-80:], e["text"])
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == text == plain["text"]
    with open(clips["s2"], "rb") as f:  # the official client takes the segment events too
        kinds = [e.type for e in client.audio.transcriptions.create(model="m", file=f, stream=True,
                                                                    response_format="verbose_json")]
    assert "transcript.text.segment" in kinds and kinds[-1] == "transcript.text.done"


def test_concurrent_requests_match_offline(server, clips, offline) -> None:
    names = [f"s{k % 6}" for k in range(24)] + ["flac"] * 2
    streamed = {k for k in range(len(names)) if k % 3 == 0}

    def one(k: int) -> str:
        data = {"model": "qasr", **({"stream": "true"} if k in streamed else {})}
        r = post(server, files={"file": open(clips[names[k]], "rb")}, data=data, timeout=120)
        assert r.status_code == 200, r.text
        return _sse(r)[-1]["text"] if k in streamed else r.json()["text"]

    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(one, range(len(names))))
    assert texts == [offline[n] for n in names]


@pytest.mark.slow
def test_64_concurrent_requests_all_answered(tmp_path_factory, clips, offline) -> None:
    """64 clients at once against a server with the default queue limit: every request answered, each
    text equal to the offline one, nothing lost or duplicated (a third of them streamed)."""
    srv = ServerProcess(tmp_path_factory.mktemp("server64") / "serve.log")
    try:
        srv.wait_ready()
        names = [f"s{k % 6}" for k in range(60)] + ["flac"] * 4

        def one(k: int) -> str:
            stream = k % 3 == 0
            r = post(srv, files={"file": open(clips[names[k]], "rb")}, data={"stream": "true"} if stream else {},
                     timeout=300)
            assert r.status_code == 200, r.text
            return _sse(r)[-1]["text"] if stream else r.json()["text"]

        with ThreadPoolExecutor(len(names)) as pool:
            texts = list(pool.map(one, range(len(names))))
        assert texts == [offline[n] for n in names]
        done = httpx.get(f"{srv.url}/metrics").text
        assert metric(done, "qasr_http_requests_total", route="/v1/audio/transcriptions", status="200") == 64
    finally:
        srv.stop()


def test_bad_uploads_get_400_in_openai_shape(server, clips) -> None:
    good = clips["s0"].read_bytes()
    multipart = {**server.headers, "content-type": "multipart/form-data; boundary=xx"}
    assert_error(post(server, content=b"--xx\r\nContent-Disposition: form-data\r\n\r\nabc\r\n--xx--\r\n",
                      headers=multipart), 400, "malformed multipart")
    assert_error(post(server, content=b"--xx\r\ngarbage", headers=multipart), 400, "'file'")  # no parts at all
    assert_error(post(server, content=b"hello", headers={**server.headers, "content-type": "multipart/form-data"}),
                 400, "malformed multipart")
    assert_error(post(server, json={"file": "x"}), 400, "multipart/form-data")
    other = {"other": ("x.txt", b"1")}  # forces a multipart body
    assert_error(post(server, files=other, data={"model": "m"}), 400, "the audio file is missing", param="file")
    assert_error(post(server, files=other, data={"file": "not a file"}), 400, "file upload", param="file")
    rng = np.random.default_rng(0)
    err = assert_error(post(server, files={"file": ("junk.mp3", rng.integers(0, 256, 5000, np.uint8).tobytes())}),
                       400, "junk.mp3", param="file")
    assert err["code"] == "invalid_audio"
    assert_error(post(server, files={"file": ("empty.wav", b"")}), 400, "empty", param="file")
    nan = Path(clips["s0"]).with_name("nan.wav")
    sf.write(nan, np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT")
    assert_error(post(server, files={"file": open(nan, "rb")}), 400, "NaN", param="file")
    for lang, needle in (("Klingon", "supported"), ("fr", "English")):
        assert_error(post(server, files={"file": ("a.wav", good)}, data={"language": lang}), 400, needle,
                     param="language")
    assert_error(post(server, files={"file": ("a.wav", good)}, data={"response_format": "docx"}), 400,
                 "response_format")
    assert_error(post(server, files={"file": ("a.wav", good)}, data={"temperature": "hot"}), 400, "temperature")
    err = assert_error(post(server, files={"file": ("a.wav", good)},
                            data={"response_format": "verbose_json", "timestamp_granularities[]": ["segment", "word"]}),
                       400, "word timestamps need an aligner (--aligner)")
    assert err["param"] == "timestamp_granularities"
    assert_error(httpx.post(f"{server.url}/v1/audio/translations", files={"file": ("a.wav", good)},
                            headers=server.headers), 400, "does not translate")
    assert post(server, files={"file": ("a.wav", good)}, data={"chunking_strategy": "auto"}).json()["text"] == \
        "set an alarm for six forty five"


def test_oversized_uploads_get_413(server) -> None:
    big = np.zeros(4 * 2**20, np.uint8).tobytes()  # 4 MiB against --max-upload-mb 3
    assert_error(post(server, files={"file": ("big.wav", big)}), 413, "3 MB", param="file")

    def chunked():  # no Content-Length: counted while it streams in
        head = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.wav\"\r\n"
                b"Content-Type: audio/wav\r\n\r\n")
        yield head
        for _ in range(64):
            yield bytes(64 * 1024)
        yield b"\r\n--b--\r\n"

    r = post(server, content=chunked(), headers={**server.headers, "content-type": "multipart/form-data; boundary=b"})
    assert_error(r, 413, "--max-upload-mb", param="file")
    assert httpx.get(f"{server.url}/health").status_code == 200  # the server is fine afterwards


def test_api_key(server, clips) -> None:
    files = {"file": ("a.wav", clips["s0"].read_bytes())}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        err = assert_error(post(server, files=files, headers=headers), 401, "API key")
        assert err["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert KEY not in server.log()


def test_models_and_metrics(server, client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [str(DEMO_MODEL), "qasr-demo-en"]
    extra = client.models.retrieve(ids[1]).model_extra
    assert extra["word_timestamps"] is False  # no --aligner
    assert extra["quantize"] == "none" and extra["kv_cache_dtype"] == "auto" and "int8" not in extra["kernels"]
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    assert metric(text, "qasr_http_requests_total", route="/v1/audio/transcriptions", status="200") > 0
    assert metric(text, "qasr_http_requests_total", route="/v1/audio/transcriptions", status="400") > 0
    assert metric(text, "qasr_audio_seconds_total") > 0
    assert metric(text, "qasr_time_to_first_token_seconds_count") > 0
    assert 'qasr_http_request_duration_seconds_bucket{le="0.5",route="/v1/audio/transcriptions"}' in text
    assert metric(text, "qasr_engine_kv_tokens_total") > 0 and metric(text, "qasr_engine_kv_blocks_total") > 0
    assert metric(text, "qasr_engine_kv_blocks_used") == 0 and metric(text, "qasr_engine_preemptions_total") == 0
    assert metric(text, "qasr_engine_running_requests") == 0 and metric(text, "qasr_queued_audio_seconds") == 0


def _engine_idle(server: ServerProcess, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
        idle = all(metric(text, m) == 0 for m in ("qasr_engine_running_requests", "qasr_engine_waiting_requests",
                                                 "qasr_engine_kv_tokens_used", "qasr_queued_audio_seconds"))
        if idle or time.monotonic() > deadline:
            assert idle, text
            return text
        time.sleep(0.05)


def test_disconnects_cancel_their_requests(server, clips) -> None:
    before = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    audio_before = metric(before, "qasr_audio_seconds_total")
    # a streamed request: read the first delta, then hang up
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url}/v1/audio/transcriptions",
                                                 files={"file": open(clips["long"], "rb")},
                                                 data={"stream": "true"}, headers=server.headers) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ") and "transcript.text.delta" in first
    after = _engine_idle(server)
    assert metric(after, "qasr_audio_seconds_total") == audio_before  # never finished: it was cancelled
    # a plain request whose client gives up while the engine works on it
    with pytest.raises(httpx.ReadTimeout):
        post(server, files={"file": open(clips["long"], "rb")}, timeout=httpx.Timeout(60, read=0.05))
    # the server notices the hang-up while decoding (off the engine) or transcribing, so "idle" can come
    # first on a busy machine: wait for the 499 itself
    deadline = time.monotonic() + 60
    after = _engine_idle(server)
    while (metric(after, "qasr_http_requests_total", route="/v1/audio/transcriptions", status="499") < 1
           and time.monotonic() < deadline):
        time.sleep(0.1)
        after = _engine_idle(server)
    assert metric(after, "qasr_http_requests_total", route="/v1/audio/transcriptions", status="499") == 1
    assert metric(after, "qasr_audio_seconds_total") == audio_before
    assert post(server, files={"file": open(clips["s0"], "rb")}).status_code == 200  # and all is well


def test_queue_limit_gives_429_with_retry_after(server, clips, offline) -> None:
    # each long clip alone exceeds QUEUE_LIMIT_S: the first is admitted into the empty queue, and the others
    # arrive while it is being transcribed
    def one(_: int) -> httpx.Response:
        return post(server, files={"file": open(clips["long"], "rb")}, timeout=120)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, range(6)))
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in answers)
    for r in refused:
        assert assert_error(r, 429, "queue is full")["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    assert all(r.json()["text"] == offline["long"] for r in answers if r.status_code == 200)
    _engine_idle(server)


def test_page_is_served_and_targets_the_real_routes(server) -> None:
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script src=" not in page and "MediaRecorder" in page and "getReader" in page
    assert not re.search(r"https?://", page), "the page must fetch nothing from elsewhere"
    urls = dict(re.findall(r'const (\w+_URL) = "([^"]+)";', page))
    assert urls == {"TRANSCRIBE_URL": "/v1/audio/transcriptions", "MODELS_URL": "/v1/models",
                    "STREAM_URL": "/v1/stream"}
    assert re.findall(r"fetch\((\w+)", page) == ["TRANSCRIBE_URL", "MODELS_URL"]
    assert "STREAM_URL, protocols)" in page  # live captions open the WebSocket route (tested in a browser)
    assert "event.delta" in page and "transcript.text.done" in page
    assert httpx.get(f"{server.url}{urls['MODELS_URL']}", headers=server.headers).status_code == 200
    assert post(server, data={"x": "1"}).status_code == 400  # the route exists (400 for a missing file)


@pytest.fixture(scope="module")
def unlimited(tmp_path_factory):
    """A server without the queue limit, so long uploads are all admitted at once."""
    with ServerProcess(tmp_path_factory.mktemp("unlimited") / "serve.log", "--max-upload-mb", "3",
                       api_key=KEY) as srv:
        yield srv


def test_requests_from_many_threads_share_one_engine(unlimited, clips) -> None:
    # no global lock: while long requests are being transcribed, a short one sent after them finishes first
    done: dict[str, float] = {}

    def long(k: int) -> None:
        assert post(unlimited, files={"file": open(clips["long"], "rb")}, timeout=120).status_code == 200
        done[f"long{k}"] = time.monotonic()

    threads = [threading.Thread(target=long, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert post(unlimited, files={"file": open(clips["s3"], "rb")}).status_code == 200
    done["short"] = time.monotonic()
    for t in threads:
        t.join(120)
    assert done["short"] < max(done["long0"], done["long1"]), done


