"""Scale-out on a Ray cluster (docs/scaling.md). Only ``commands``, ``ray_data`` and ``ray_serve``
import Ray, and only when used."""
