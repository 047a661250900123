"""The ``--ray`` options of ``qasr transcribe`` and ``qasr serve`` (argparse only). ``--ray`` takes an
optional ADDRESS, so ``split_ray_address`` keeps ``--ray in/`` from reading the folder as one.
"""

from __future__ import annotations

import argparse
import os
import re

from qasr.cli.argtypes import positive_float, positive_int

# what `ray.init(address=...)` accepts: auto, local, ray://host:port (Ray Client), host:port (GCS)
_ADDRESS = re.compile(r"^(auto|local|(ray|anyscale)://\S+|\[[0-9A-Fa-f:]+\]:\d+|[A-Za-z0-9._-]+:\d+)$")


def is_ray_address(text: str) -> bool:
    """True for a value of ``--ray`` that names a cluster rather than an input path."""
    return bool(_ADDRESS.match(text)) and not os.path.exists(text)


def split_ray_address(argv: list[str]) -> list[str]:
    """``--ray X`` becomes ``--ray= X`` (no address, X an input) when X is not a Ray address."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--ray" and not out[i + 1].startswith("-") and not is_ray_address(out[i + 1]):
            out[i] = "--ray="
    return out


def _actors(text: str) -> tuple[int, int]:
    """``N`` (a fixed pool) or ``MIN-MAX`` (autoscaling between them)."""
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _address_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help=f"{what} on a Ray cluster (needs the ray extra): ADDRESS is auto, local, "
                             "ray://HOST:10001 or HOST:6379; without one, the cluster in RAY_ADDRESS or one "
                             "running on this machine, else a new local one (docs/scaling.md)")


def add_transcribe_options(parser: argparse.ArgumentParser) -> None:
    """``qasr transcribe --ray``: the pipeline's pool of ASR actors and its decode tasks."""
    _address_option(parser, "run the job")
    g = parser.add_argument_group("Ray (with --ray)")
    g.add_argument("--ray-actors", type=_actors, default=None, metavar="N|MIN-MAX",
                   help="ASR actors, each with its own engine: a fixed number or an autoscaling range "
                        "(default 1 to as many as the cluster holds)")
    g.add_argument("--ray-actor-gpus", type=_non_negative, default=None, metavar="G",
                   help="GPUs per ASR actor (default 1 when the cluster has GPUs, else 0)")
    g.add_argument("--ray-actor-cpus", type=positive_float, default=None, metavar="C",
                   help="CPU cores per ASR actor; on CPUs its engine runs that many threads "
                        "(default 1 with a GPU, else up to 4)")
    g.add_argument("--ray-decode-cpus", type=positive_float, default=1.0, metavar="C",
                   help="CPU cores per decode task (decode, resample, VAD; default 1)")
    g.add_argument("--ray-batch", type=positive_int, default=16, metavar="N",
                   help="segments per call of an ASR actor (default 16); 4 calls run at once per actor")


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """``qasr serve --ray``: replicas of the server as a Ray Serve deployment."""
    _address_option(parser, "serve")
    g = parser.add_argument_group("Ray Serve (with --ray)")
    g.add_argument("--ray-replicas", type=_actors, default=(1, 1), metavar="N|MIN-MAX",
                   help="replicas, each with its own engine: a fixed number or an autoscaling range (default 1)")
    g.add_argument("--ray-replica-gpus", type=_non_negative, default=None, metavar="G",
                   help="GPUs per replica (default 1 when the cluster has GPUs, else 0)")
    g.add_argument("--ray-replica-cpus", type=positive_float, default=None, metavar="C",
                   help="CPU cores per replica (default 1 with a GPU, else up to 4)")
    g.add_argument("--ray-max-ongoing", type=positive_int, default=None, metavar="N",
                   help="requests (WebSocket sessions included) one replica takes at once (default: "
                        "--max-running plus --max-live-sessions, so the engine can batch them)")
    g.add_argument("--ray-target-ongoing", type=positive_float, default=None, metavar="N",
                   help="ongoing requests per replica the autoscaler aims for (default: half of --max-running)")
