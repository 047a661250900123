"""Scale-out on a Ray cluster (``pip install 'qasr[ray]'``; docs/scaling.md).

- ``qasr transcribe --ray``: a Ray Data pipeline (``ray_data.RayTranscriber``): inputs are decoded and cut
  into segments by CPU tasks, transcribed by an autoscaling pool of ASR actors (one engine each), and the
  driver assembles each input and hands it to the single-machine job runner, which writes its outputs.
- ``qasr serve --ray``: the server's FastAPI app as a Ray Serve deployment (``ray_serve``).

This package is the only one that imports Ray, and only its ``runtime``, ``ray_data``, ``ray_serve`` and
the CLI glue modules do, when they are used: importing ``qasr.distributed`` itself needs no Ray.
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'qasr[ray]'"


class RayMissing(RuntimeError):
    """Ray is not installed; the message says how to install it."""


def require_ray() -> None:
    """Raise RayMissing with the install command when Ray (with Data and Serve) cannot be imported."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise RayMissing(f"--ray needs Ray, which is not installed: {INSTALL_HINT} ({exc})") from exc
