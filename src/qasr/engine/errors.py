"""What a request's future raises when the engine, not the request, ended it."""

from __future__ import annotations


class EngineClosed(RuntimeError):
    """The engine was closed before this request finished, or is closed now."""


class EngineBroken(RuntimeError):
    """The engine's loop failed; pending and later requests fail with it (``__cause__``: the error)."""
