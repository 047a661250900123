"""The ``--ray`` commands: join a Ray cluster, run ``qasr transcribe --ray`` (the job runner with a
``RayTranscriber`` for an ASR) or ``qasr serve --ray`` (until SIGINT/SIGTERM), leave.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable

from qasr.distributed.config import (
    Cluster,
    EngineSpec,
    ServeScaling,
    engine_threads,
    model_problem,
    pool_config,
    portable,
    worker_shape,
)
from qasr.jobs.plan import Job

INSTALL_HINT = "pip install 'qasr[ray]'"


class RayMissing(RuntimeError):
    """Ray is not installed; the message says how to install it."""


def require_ray() -> None:
    """Raise RayMissing, with the install command, when Ray cannot be imported."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise RayMissing(f"--ray needs Ray, which is not installed: {INSTALL_HINT} ({exc})") from exc


EXIT_USAGE = 2
EXIT_FAILED = 1


def connect(address: str | None) -> bool:
    """Join the cluster at ``address`` (None or "": RAY_ADDRESS, else a local one), unless this process
    already has a runtime. True when this call connected, so the caller disconnects."""
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    # Ray's start-up chatter would bury the job's own messages
    ray.init(address=address or None, logging_level=logging.WARNING)
    return True


def disconnect() -> None:
    import ray

    ray.shutdown()


def cluster_now() -> Cluster:
    import ray

    return Cluster.from_ray(ray.cluster_resources(), ray.nodes())


def usage_error(message: str) -> int:
    print(f"qasr: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def on_cluster(address: str | None, model: str, work: Callable[[], int]) -> int:
    """Check the model, join the cluster, run ``work``, leave; a usage error (exit 2) when the model is
    missing, Ray is not installed or the cluster cannot be joined."""
    problem = model_problem(model)
    if problem is not None:
        return usage_error(problem)
    try:
        connected = connect(address)
    except RayMissing as exc:
        return usage_error(str(exc))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return usage_error(f"cannot join the Ray cluster at {address or 'the default address'}: {exc}")
    try:
        return work()
    finally:
        if connected:
            disconnect()


def run_on_ray(todo: list[Job], args: argparse.Namespace, total_inputs: int) -> int:
    return on_cluster(args.ray, args.model, lambda: _run(todo, args, total_inputs, cluster_now()))


def _run(todo: list[Job], args: argparse.Namespace, total_inputs: int, cluster) -> int:  # noqa: ANN001
    from qasr.distributed.ray_data import RayTranscriber
    from qasr.jobs.runner import run_jobs

    pool = pool_config(cluster, actors=args.ray_actors, cpus=args.ray_actor_cpus, gpus=args.ray_actor_gpus,
                       decode_cpus=args.ray_decode_cpus, batch_size=args.ray_batch)
    spec = EngineSpec(portable(args.model), device=args.device, dtype=args.dtype, aligner=portable(args.aligner),
                      max_running=args.max_running, threads=engine_threads(pool.actor_cpus, pool.actor_gpus),
                      quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
    transcriber = RayTranscriber(spec, pool)
    try:
        transcriber.check_language(args.language)
    except ValueError as exc:
        return usage_error(str(exc))
    actors = str(pool.min_actors) if pool.min_actors == pool.max_actors else f"{pool.min_actors}-{pool.max_actors}"
    plural = "s" if pool.max_actors > 1 else ""
    print(f"qasr: ray: {len(todo)} inputs, {actors} ASR actor{plural} ({pool.actor_cpus:g} CPU, "
          f"{pool.actor_gpus:g} GPU each) on a cluster of {cluster.cpus:g} CPUs, {cluster.gpus:g} GPUs",
          file=sys.stderr)
    try:
        code = run_jobs(transcriber, todo, args, total_inputs)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the cluster gave up
        detail = str(exc).strip().splitlines()
        print(f"qasr: error: the Ray job failed: {type(exc).__name__}: {detail[0] if detail else ''}\n"
              "qasr: the outputs written so far are complete; run the same command again to do the rest",
              file=sys.stderr)
        return EXIT_FAILED
    passes = f"{transcriber.passes} pass" + ("es" if transcriber.passes != 1 else "")
    print(f"qasr: ray: {passes}, {transcriber.redone} segments redone after their worker died, "
          f"{transcriber.repeats} repeated results ignored", file=sys.stderr)
    return code


def serve_on_ray(args: argparse.Namespace, config: object) -> int:
    return on_cluster(args.ray, args.model, lambda: _serve(args, config))


def scaling_of(args: argparse.Namespace, cpus: float, gpus: float) -> ServeScaling:
    """The replicas the options ask for. By default a replica takes its engine's batch plus its live
    sessions, and the autoscaler adds one past half the engine's batch per replica."""
    low, high = args.ray_replicas
    max_ongoing = args.ray_max_ongoing or args.max_running + getattr(args, "max_live_sessions", 0)
    target = args.ray_target_ongoing or max(1.0, args.max_running / 2)
    return ServeScaling(low, high, cpus, gpus, max_ongoing_requests=max_ongoing, target_ongoing_requests=target)


def _serve(args: argparse.Namespace, config: object) -> int:
    from qasr.distributed.ray_serve import deploy, undeploy

    cluster = cluster_now()
    cpus, gpus = worker_shape(cluster, args.ray_replica_cpus, args.ray_replica_gpus)
    spec = EngineSpec(portable(args.model), device=args.device, dtype=args.dtype, aligner=portable(args.aligner),
                      max_running=args.max_running, threads=engine_threads(cpus, gpus), quantize=args.quantize,
                      kv_cache_dtype=args.kv_cache_dtype)
    scaling = scaling_of(args, cpus, gpus)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    replicas = (str(scaling.min_replicas) if scaling.min_replicas == scaling.max_replicas
                else f"{scaling.min_replicas}-{scaling.max_replicas}")
    print(f"qasr: ray: deploying {replicas} replicas ({cpus:g} CPU, {gpus:g} GPU each) on a cluster of "
          f"{cluster.cpus:g} CPUs, {cluster.gpus:g} GPUs", file=sys.stderr, flush=True)
    try:
        url = deploy(config, spec, scaling, args.host, args.port)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - Serve gave up
        undeploy()
        detail = str(exc).strip().splitlines()
        print(f"qasr: error: the deployment failed: {type(exc).__name__}: {detail[0] if detail else ''}",
              file=sys.stderr)
        return EXIT_FAILED
    try:
        print(f"qasr: ray: serving {url} (Ctrl-C or SIGTERM stops)", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
        print("qasr: ray: stopping: replicas finish their requests, then the app is removed", file=sys.stderr,
              flush=True)
    finally:
        undeploy()
    return 0
