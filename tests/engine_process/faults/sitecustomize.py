"""Faults injected into the engine process for the recovery tests, which put this folder on PYTHONPATH (a spawned
engine process inherits it). Once the file named by QASR_TEST_FAULT exists, the next ``EngineCore.step`` in a
process named ``qasr-engine`` removes it and does what it says: ``raise`` (the step raises: the engine loop
breaks), ``sleep`` (the step never returns), ``gil`` (the step never returns and holds the GIL), ``slow`` (this
and every later step take at least SLOW_STEP_S more: work that lasts on any machine)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType

FAULT_FILE = os.environ.get("QASR_TEST_FAULT")
SLOW_STEP_S = 0.1
_slow = False


def _fault() -> str | None:
    """The fault to do now (taken: the file is gone after), or None."""
    import multiprocessing

    if FAULT_FILE is None or multiprocessing.current_process().name != "qasr-engine":
        return None
    try:
        with open(FAULT_FILE) as f:
            fault = f.read().strip()
        os.unlink(FAULT_FILE)
    except FileNotFoundError:
        return None
    return fault


def _patch(module: ModuleType) -> None:
    real_step = module.EngineCore.step

    def step(self: object) -> None:
        global _slow
        fault = _fault()
        if fault == "slow":
            _slow = True
        if _slow:
            import time

            time.sleep(SLOW_STEP_S)
        if fault == "raise":
            raise RuntimeError("injected fault: the step failed")
        if fault == "sleep":
            import time

            time.sleep(3600)
        if fault == "gil":
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # a PyDLL call keeps the GIL while it runs
        real_step(self)

    module.EngineCore.step = step


class _PatchEngineCore(importlib.abc.MetaPathFinder):
    """Patches qasr.engine.core as it is imported."""

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != "qasr.engine.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if FAULT_FILE:
    sys.meta_path.insert(0, _PatchEngineCore())
