"""``qasr serve --ray``: the server as a Ray Serve deployment on a local Ray runtime (2 CPUs), 2 replicas of the
demo model, driven by the official ``openai`` client and a WebSocket client.

Covers: the OpenAI client's answers equal the offline transcripts; 16 concurrent requests are shared by both
replicas (each response names its replica); a live WebSocket session works through Serve's proxy; SIGINT
removes the app and exits 0; a replica whose engine is broken fails its health check; the replica and
autoscaling options. Marked ``ray`` (``make test-ray``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_proc import free_port, qasr_command

from qasr.testing.speech import speak

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")
# Ray and Ray Serve warn about their own deprecated internals (pydantic fields, DataContext options)
pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "qasr-demo-en"
SENTENCES = ("set an alarm for six", "call anna tomorrow", "turn off the lights", "what is the weather",
             "play some music", "remind me at nine", "set a timer for ten minutes", "call anna on the ninth of july")


@pytest.fixture(scope="module")
def runtime():
    ray.init(num_cpus=2, object_store_memory=200 * 10**6, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("serve_audio")
    return [speak(SENTENCES[k % len(SENTENCES)], d / f"c{k:02d}.wav", speed=140 + 6 * k) for k in range(16)]


@pytest.fixture(scope="module")
def offline(clips) -> list[str]:
    from qasr import ASR

    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32")
    texts = [r.text for r in asr.transcribe([str(p) for p in clips])]
    asr._core.engine.close(drain=False, timeout=30)
    assert all(texts)
    return texts


@pytest.fixture(scope="module")
def server(runtime, tmp_path_factory):
    """``qasr serve --ray`` joining the runtime: 2 replicas of half a core each."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - a file, not a pipe: Serve's logs would fill a pipe and block it
    proc = subprocess.Popen(qasr_command("serve", "--ray", runtime, "-m", str(DEMO), "--device",
                                         "cpu", "--dtype", "float32", "--port", str(port), "--ray-replicas", "2",
                                         "--ray-replica-cpus", "0.5"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while f"serving {url}" not in log_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
    yield url, proc, log_path
    if proc.poll() is None:
        proc.kill()
    log.close()


def test_openai_client_answers_and_two_replicas_share_16_requests(server, clips, offline) -> None:
    url = server[0]
    # serving only starts once both replicas have loaded their model: no request ever meets a cold one
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def transcribe(path: Path) -> tuple[str, str]:
        with open(path, "rb") as f:
            raw = client.audio.transcriptions.with_raw_response.create(model="qasr-demo-en", file=f)
        return raw.headers["x-qasr-replica"], raw.parse().text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(transcribe, clips))
    assert [text for _, text in answers] == offline
    served_by = [replica for replica, _ in answers]
    assert len(set(served_by)) == 2, f"one replica took every request: {served_by}"


def test_a_live_websocket_session_stays_on_its_replica(server, clips, offline) -> None:
    from qasr.audio.io import load_audio

    url = server[0].replace("http://", "ws://") + "/v1/stream"
    wave = load_audio(clips[0])  # 16 kHz float32

    async def session() -> list[dict]:
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000, "format": "float32"}))
            data = wave.astype("<f4").tobytes()
            for i in range(0, len(data), 12800):  # 200 ms a message
                await ws.send(data[i:i + 12800])
            await ws.send(json.dumps({"type": "end"}))
            return [json.loads(m) async for m in ws]

    messages = asyncio.run(session())
    assert messages[0]["type"] == "ready" and not [m for m in messages if m["type"] == "error"], messages
    finals = [m["text"] for m in messages if m["type"] == "final"]
    assert finals == [offline[0]]
    assert messages[-1]["type"] == "done"
    assert messages[-1]["audio_seconds"] == pytest.approx(len(wave) / 16000, abs=0.01)


def test_sigint_removes_the_app_and_exits_0(server) -> None:
    url, proc, log_path = server
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log_path.read_text()
    assert "stopping" in log_path.read_text()
    from ray import serve

    assert "qasr" not in serve.status().applications


def test_a_replica_whose_engine_broke_fails_its_health_check(runtime, tiny_original) -> None:  # noqa: ANN001
    from ray import serve

    from qasr.distributed.config import ServeScaling
    from qasr.distributed.ray_serve import qasr_application
    from qasr.server.config import ServerConfig

    model = str(tiny_original)

    class BreakingSpec:  # EngineSpec's part a replica uses; defined here, so shipped to the replica by value
        def load(self):  # noqa: ANN202 - an ASR
            """The tiny model's ASR, its engine's loop failed by a forward pass that raises a fatal error."""
            import numpy as np

            from qasr import ASR

            class Fatal(BaseException):
                pass

            def fail(plan: object) -> object:
                raise Fatal("the device went away")

            asr = ASR.from_pretrained(model, device="cpu", dtype="float32")
            asr._core.engine.core.runner.forward = fail
            noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
            with contextlib.suppress(Exception):
                asr.transcribe((noise, 16000))
            assert asr._core.engine.stats().broken
            return asr

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # no-op if the server test started it
    config = ServerConfig(model=model, served_names=("tiny",), warmup=False)  # no warm-up: it would fail the load
    try:
        # Serve checks a replica's health as it starts: the broken one never counts as started
        with pytest.raises(RuntimeError, match="Deploying application broken failed"):
            serve.run(qasr_application(config, BreakingSpec(), ServeScaling(replica_cpus=0.5)),
                      name="broken", route_prefix="/broken")
        status = serve.status().applications["broken"]
        assert status.status == "DEPLOY_FAILED"
        assert "asr engine broken: its loop failed" in status.deployments["qasr"].message
    finally:
        serve.delete("broken")


def test_replica_and_autoscaling_options() -> None:
    from qasr.distributed.commands import scaling_of
    from qasr.distributed.config import ServeScaling

    args = argparse.Namespace(ray_replicas=(1, 4), ray_max_ongoing=None, ray_target_ongoing=None, max_running=64,
                              max_live_sessions=16)
    scaling = scaling_of(args, cpus=1.0, gpus=1.0)
    options = scaling.deployment_options()
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32.0}
    assert options["max_ongoing_requests"] == 64 + 16  # the engine's batch plus its live sessions
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0} and "num_replicas" not in options
    fixed = ServeScaling(2, 2).deployment_options()
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    from ray import serve

    from qasr.distributed.ray_serve import build_app  # the builder `serve run` and RayService use

    assert isinstance(build_app({"model": str(DEMO), "replicas": "1-3", "replica_cpus": "2"}), serve.Application)
