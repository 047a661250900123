"""The engine's own exceptions: what a caller's future raises when the engine, not the request, ended it."""

from __future__ import annotations


class EngineClosed(RuntimeError):
    """The engine was closed before this request finished (``close(drain=False)``), or is closed now."""


class EngineBroken(RuntimeError):
    """The engine's loop hit an unexpected error; every pending request fails with it, and so does every
    later submit. ``__cause__`` holds the original exception."""
