"""``qasr serve --ray``: the server's own app as a Ray Serve deployment, each replica loading its
engine as ``qasr serve`` does (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from qasr.distributed.config import EngineSpec, ServeScaling, engine_threads

if TYPE_CHECKING:
    from fastapi import FastAPI

    from qasr.server.config import ServerConfig
    from qasr.server.state import ServerState

APP_NAME = "qasr"
REPLICA_HEADER = b"x-qasr-replica"
LOAD_TIMEOUT_S = 1800.0  # a replica whose model is not loaded by then is unhealthy


class ReplicaHeader:
    """ASGI middleware naming the replica in every HTTP response."""

    def __init__(self, app, replica: str) -> None:  # noqa: ANN001 - any ASGI app
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI triple
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, send_named)


def replica_app(config: ServerConfig, spec: EngineSpec) -> FastAPI:
    """The app one replica serves: ``qasr serve``'s, loading its engine from ``spec``."""
    import ray

    from qasr.server.app import create_app

    app = create_app(config, spec.load)
    app.add_middleware(ReplicaHeader, replica=ray.get_runtime_context().get_actor_id())
    return app


async def wait_until_loaded(state: ServerState, timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Return once the model is loaded and warmed up; raise when it failed or took too long."""
    deadline = time.monotonic() + timeout_s
    while not state.ready:
        error = state.load_error
        if error is not None:
            raise RuntimeError(f"the model failed to load: {error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the model did not load within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def qasr_application(config: ServerConfig, spec: EngineSpec, scaling: ServeScaling):  # noqa: ANN201
    """The bound Serve application: ``serve.run(qasr_application(...), route_prefix="/")``."""
    from ray import serve

    def build() -> FastAPI:  # runs in each replica as it starts
        return replica_app(config, spec)

    @serve.ingress(build)
    class QasrReplica:
        """One qasr server with its own engine."""

        async def check_health(self) -> None:
            """Raises (so Serve replaces this replica) until the model loaded, and when an engine is broken
            or stalled (the rule of /health)."""
            state = self.app.state.qasr  # type: ignore[attr-defined] - the ingress wrapper's app
            await wait_until_loaded(state)
            trouble = state.engine_trouble()
            if trouble is not None:
                raise RuntimeError(trouble[1])

    deployment = serve.deployment(QasrReplica, name=APP_NAME, health_check_timeout_s=LOAD_TIMEOUT_S,
                                  graceful_shutdown_timeout_s=60, **scaling.deployment_options())
    return deployment.bind()


def deploy(config: ServerConfig, spec: EngineSpec, scaling: ServeScaling, host: str, port: int) -> str:
    """Start Serve's proxies on ``host:port`` if needed and run the app; returns its URL once every
    replica has loaded its model."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(qasr_application(config, spec, scaling), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def undeploy() -> None:
    """Remove the app: replicas finish their requests, then their engines close."""
    from ray import serve

    serve.delete(APP_NAME)


def build_app(args: dict) -> object:
    """Serve application builder: ``serve run qasr.distributed.ray_serve:build_app model=PATH replicas=1-4``.
    Keys (strings): model (required), device, dtype, quantize, kv_cache_dtype, aligner, max_running,
    replicas (N or MIN-MAX), replica_cpus, replica_gpus, max_ongoing, target_ongoing, api_key."""
    from qasr.server.config import ServerConfig

    model = str(args["model"])
    low, _, high = str(args.get("replicas", "1")).partition("-")
    gpus = float(args.get("replica_gpus", 0))
    cpus = float(args.get("replica_cpus", 1))
    max_running = int(args.get("max_running", 64))
    spec = EngineSpec(model, device=str(args.get("device", "auto")), dtype=str(args.get("dtype", "auto")),
                      aligner=args.get("aligner"), max_running=max_running, threads=engine_threads(cpus, gpus),
                      quantize=args.get("quantize"), kv_cache_dtype=str(args.get("kv_cache_dtype", "auto")))
    scaling = ServeScaling(int(low), int(high or low), cpus, gpus,
                           max_ongoing_requests=int(args.get("max_ongoing", 2 * max_running)),
                           target_ongoing_requests=float(args.get("target_ongoing", max_running / 2)))
    names = tuple(dict.fromkeys([model, model.rstrip("/").rsplit("/", 1)[-1]]))
    config = ServerConfig(model=model, served_names=names, api_key=args.get("api_key"), aligner=args.get("aligner"))
    return qasr_application(config, spec, scaling)
