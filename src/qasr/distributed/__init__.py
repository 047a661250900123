"""Scale-out on a Ray cluster (``pip install 'qasr[ray]'``; docs/scaling.md).

- ``qasr transcribe --ray``: a Ray Data pipeline (``ray_data.RayTranscriber``): inputs are decoded and cut
  into segments by CPU tasks, transcribed by an autoscaling pool of ASR actors (one engine each), and the
  driver assembles each input and hands it to the single-machine job runner, which writes its outputs.
- ``qasr serve --ray``: the server's FastAPI app as a Ray Serve deployment (``ray_serve``).

This package is the only one that imports Ray, and only its ``commands``, ``ray_data`` and ``ray_serve``
modules do, when they are used: importing ``qasr.distributed`` itself needs no Ray.
"""
