"""``qasr transcribe --ray``: the planned jobs through ``RayTranscriber`` and the single-machine job runner.

The command line has already found the inputs, planned their outputs and dropped those already done (the
done-set comes from OUT, as without --ray); ``run_jobs`` then writes each input's outputs atomically the
moment the cluster hands back its last segment, shows progress, lists failures in OUT/failed.tsv and stops
cleanly on Ctrl-C, exactly as on one machine.
"""

from __future__ import annotations

import argparse
import sys

from qasr.distributed.config import EngineSpec, engine_threads, pool_config, portable
from qasr.jobs.plan import Job

EXIT_FAILED = 1


def run_on_ray(todo: list[Job], args: argparse.Namespace, total_inputs: int) -> int:
    from qasr.distributed.runtime import cluster_now, on_cluster

    return on_cluster(args.ray, args.model, lambda: _run(todo, args, total_inputs, cluster_now()))


def _run(todo: list[Job], args: argparse.Namespace, total_inputs: int, cluster) -> int:  # noqa: ANN001
    from qasr.distributed.ray_data import RayTranscriber
    from qasr.distributed.runtime import usage_error
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
        code = run_jobs(transcriber, todo, args, total_inputs)  # type: ignore[arg-type] - same transcribe_iter
    except Exception as exc:  # noqa: BLE001 - the cluster gave up (e.g. no actor could load the model)
        detail = str(exc).strip().splitlines()
        print(f"qasr: error: the Ray job failed: {type(exc).__name__}: {detail[0] if detail else ''}\n"
              "qasr: the outputs written so far are complete; run the same command again to do the rest",
              file=sys.stderr)
        return EXIT_FAILED
    passes = f"{transcriber.passes} pass" + ("es" if transcriber.passes != 1 else "")
    print(f"qasr: ray: {passes}, {transcriber.redone} segments redone after their worker died, "
          f"{transcriber.repeats} repeated results ignored", file=sys.stderr)
    return code

