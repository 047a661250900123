"""Connecting to a Ray cluster, and what it holds."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from qasr.distributed import RayMissing, require_ray
from qasr.distributed.config import Cluster, model_problem

EXIT_USAGE = 2


def connect(address: str | None) -> bool:
    """Join the cluster at ``address`` ("" or None: RAY_ADDRESS, else one running on this machine, else a new
    local one), or keep the runtime this process already has. True when this call connected, so the caller
    disconnects (and stops a runtime it started) when it is done."""
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    # WARNING: Ray's start-up chatter would bury the job's own messages; its warnings and errors still show
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
    """Check the model, join the cluster, run ``work`` and leave; a usage error (exit 2) when the model is
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
