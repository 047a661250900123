"""Arrays handed to the engine process through shared memory rather than pickled through its pipe."""

from __future__ import annotations

import _posixshmem
import contextlib
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

INLINE_BYTES = 1 << 18  # smaller arrays travel in the message itself


@dataclass(frozen=True)
class SharedArray:
    """A float32 array in a named shared-memory block; the receiver ``take``s it once, which frees the block."""

    name: str
    shape: tuple[int, ...]

    def take(self) -> np.ndarray:
        block = shared_memory.SharedMemory(self.name)
        _untrack(block)
        try:
            return np.ndarray(self.shape, np.float32, buffer=block.buf).copy()
        finally:
            block.close()
            _posixshmem.shm_unlink(block._name)  # type: ignore[attr-defined]


def share(array: np.ndarray | torch.Tensor) -> SharedArray | np.ndarray:
    """The array as the engine process receives it: a SharedArray, or the array itself when it is small.
    A SharedArray never taken must be ``discard``ed by its sender."""
    x = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.nbytes < INLINE_BYTES:
        return x
    block = shared_memory.SharedMemory(create=True, size=max(x.nbytes, 1))
    _untrack(block)  # the receiver unlinks it; the sender's tracker would unlink it again at exit
    try:
        np.ndarray(x.shape, np.float32, buffer=block.buf)[...] = x
    finally:
        block.close()
    return SharedArray(block.name, x.shape)


def received(item: SharedArray | np.ndarray | None) -> np.ndarray | None:
    """What ``share`` sent, as an array of this process."""
    return item.take() if isinstance(item, SharedArray) else item


def discard(item: object) -> None:
    """Free a SharedArray its receiver never took (it died first); anything else: no-op."""
    if isinstance(item, SharedArray):
        with contextlib.suppress(FileNotFoundError):
            block = shared_memory.SharedMemory(item.name)
            _untrack(block)
            block.close()
            _posixshmem.shm_unlink(block._name)  # type: ignore[attr-defined]


def _untrack(block: shared_memory.SharedMemory) -> None:
    # Python < 3.13 registers every opened block with the resource tracker, which would unlink it (and warn)
    # when this process exits: the owner of a block here is whoever holds its SharedArray
    with contextlib.suppress(Exception):
        resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
