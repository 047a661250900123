"""``qasr serve --ray``: deploy the server on the cluster, keep it up until SIGINT/SIGTERM, then remove it.

Replicas finish the requests they hold before they go (Serve's graceful shutdown), and their engines close
as ``qasr serve``'s do. On a cluster that outlives this command, Serve's proxies stay; only the app goes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from qasr.distributed.config import EngineSpec, ServeScaling, engine_threads, portable, worker_shape

EXIT_FAILED = 1


def serve_on_ray(args: argparse.Namespace, config: object) -> int:
    from qasr.distributed.runtime import on_cluster

    return on_cluster(args.ray, args.model, lambda: _serve(args, config))


def scaling_of(args: argparse.Namespace, cpus: float, gpus: float) -> ServeScaling:
    """The replicas the options ask for. By default a replica takes as many requests as its engine decodes
    at once plus its live sessions (each holds a request for its whole length), and the autoscaler adds
    a replica when the ongoing requests per replica pass half of the engine's batch."""
    low, high = args.ray_replicas
    max_ongoing = args.ray_max_ongoing or args.max_running + getattr(args, "max_live_sessions", 0)
    target = args.ray_target_ongoing or max(1.0, args.max_running / 2)
    return ServeScaling(low, high, cpus, gpus, max_ongoing_requests=max_ongoing, target_ongoing_requests=target)


def _serve(args: argparse.Namespace, config: object) -> int:
    from qasr.distributed.ray_serve import deploy, undeploy
    from qasr.distributed.runtime import cluster_now

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
    except Exception as exc:  # noqa: BLE001 - e.g. replicas that cannot load the model: Serve gave up
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

