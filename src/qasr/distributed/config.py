"""What each Ray worker loads and how many run: frozen, picklable settings, sized on the driver (no Ray import)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qasr.transcribe.asr import ASR

# more cores go to more engines, not more threads per engine (docs/benchmarks.md)
DEFAULT_CPU_ENGINE_THREADS = 4


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to load the engine ``qasr transcribe``/``qasr serve`` would."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    aligner: str | None = None
    max_running: int = 64
    threads: int | None = None  # None: the engine's default (EngineConfig.threads)
    quantize: str | None = None  # None/"none", "int8" or "int4"
    kv_cache_dtype: str = "auto"  # "auto" or "int8"

    def load(self) -> ASR:
        from qasr.engine.engine import EngineConfig
        from qasr.transcribe.asr import ASR

        return ASR.from_pretrained(self.model, device=self.device, dtype=self.dtype, aligner=self.aligner,
                                   quantize=self.quantize, threads=self.threads,
                                   engine=EngineConfig(max_running=self.max_running,
                                                       kv_cache_dtype=self.kv_cache_dtype))


@dataclass(frozen=True)
class PoolConfig:
    """The ASR actor pool and the CPU decode tasks."""

    min_actors: int
    max_actors: int
    actor_cpus: float
    actor_gpus: float
    decode_cpus: float = 1.0
    batch_size: int = 16  # segments per actor call
    calls_per_actor: int = 4  # concurrent calls, so the engine batches across them


@dataclass(frozen=True)
class ServeScaling:
    """The Serve deployment's replicas and their request limits."""

    min_replicas: int = 1
    max_replicas: int = 1
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing_requests: int = 128
    target_ongoing_requests: float = 32.0

    def deployment_options(self) -> dict:
        """``serve.deployment`` keyword arguments: a fixed count, or autoscaling."""
        options: dict = {"ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus},
                         "max_ongoing_requests": self.max_ongoing_requests}
        if self.min_replicas == self.max_replicas:
            options["num_replicas"] = self.min_replicas
        else:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing_requests}
        return options


@dataclass(frozen=True)
class Cluster:
    """The cluster's resources and its largest node's CPUs."""

    cpus: float
    gpus: float
    node_cpus: float

    @classmethod
    def from_ray(cls, total: Mapping[str, float], nodes: Sequence[Mapping]) -> Cluster:
        alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
        node_cpus = max((r.get("CPU", 0.0) for r in alive), default=total.get("CPU", 0.0))
        return cls(float(total.get("CPU", 0.0)), float(total.get("GPU", 0.0)), float(node_cpus))


def worker_shape(cluster: Cluster, cpus: float | None, gpus: float | None) -> tuple[float, float]:
    """``(cpus, gpus)`` of one engine: a whole GPU if any, else up to 4 cores of one node."""
    if gpus is None:
        gpus = 1.0 if cluster.gpus > 0 else 0.0
    if cpus is None:
        cpus = 1.0 if gpus > 0 else float(max(1, min(DEFAULT_CPU_ENGINE_THREADS, int(cluster.node_cpus) - 1)))
    return cpus, gpus


def engine_threads(cpus: float, gpus: float) -> int | None:
    """Torch threads for a CPU engine on ``cpus`` cores (at least 1); None for a GPU engine."""
    return None if gpus > 0 else max(1, math.floor(cpus))


def pool_config(cluster: Cluster, *, actors: tuple[int, int] | None, cpus: float | None, gpus: float | None,
                decode_cpus: float, batch_size: int) -> PoolConfig:
    """The pool the cluster holds: by default 1 up to one actor per GPU, or per ``cpus`` cores."""
    cpus, gpus = worker_shape(cluster, cpus, gpus)
    if actors is None:
        if gpus > 0:
            fit = math.floor(cluster.gpus / gpus)
        else:
            fit = math.floor(max(cluster.cpus - decode_cpus, 0.0) / cpus)
        actors = (1, max(1, fit))
    return PoolConfig(min_actors=actors[0], max_actors=actors[1], actor_cpus=cpus, actor_gpus=gpus,
                      decode_cpus=decode_cpus, batch_size=batch_size)


def portable(path: str | None) -> str | None:
    """A local checkpoint as an absolute path; a hub id as it is."""
    if path is not None and Path(path).expanduser().exists():
        return str(Path(path).expanduser().resolve())
    return path


def model_problem(model: str) -> str | None:
    """Why a local checkpoint cannot load, or None (checked before asking the cluster)."""
    from qasr.model.weights import resolve_model_dir

    if Path(model).expanduser().exists() or model.count("/") != 1:
        try:
            resolve_model_dir(model)
        except FileNotFoundError as exc:
            return str(exc)
    return None
