"""Connecting to a Ray cluster, and what it holds."""

from __future__ import annotations

import logging

from qasr.distributed import require_ray
from qasr.distributed.config import Cluster


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
