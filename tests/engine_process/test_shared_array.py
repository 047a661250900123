"""Arrays to the engine process: a large one travels as a named shared-memory block that its receiver's ``take``
frees, a small one inline in the message; a block never taken is freed by ``discard``."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from qasr.engine_process.shared_array import INLINE_BYTES, SharedArray, discard, received, share

SHM = Path("/dev/shm")


def large(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((128, INLINE_BYTES // 4 // 128 + 7)).astype(np.float32)


def test_a_large_array_goes_through_shared_memory_and_take_frees_it() -> None:
    x = large()
    sent = share(x)
    assert isinstance(sent, SharedArray) and sent.shape == x.shape
    assert (SHM / sent.name.lstrip("/")).exists()
    got = received(pickle.loads(pickle.dumps(sent)))  # as it crosses the pipe
    assert got is not None and got.dtype == np.float32 and np.array_equal(got, x)
    assert not (SHM / sent.name.lstrip("/")).exists()
    discard(sent)  # the sender's discard of a block taken already: a no-op


def test_a_small_array_travels_inline_as_float32() -> None:
    x = np.arange(1000, dtype=np.float64).reshape(10, 100)
    sent = share(x)
    assert isinstance(sent, np.ndarray) and sent.dtype == np.float32 and sent.flags.c_contiguous
    assert np.array_equal(received(sent), x.astype(np.float32))
    assert received(None) is None


def test_a_tensor_is_shared_as_its_values() -> None:
    t = torch.from_numpy(large(1)).t()  # not contiguous
    sent = share(t)
    assert isinstance(sent, SharedArray)
    assert np.array_equal(sent.take(), t.numpy())


def test_discard_frees_a_block_never_taken() -> None:
    sent = share(large(2))
    assert isinstance(sent, SharedArray)
    path = SHM / sent.name.lstrip("/")
    assert path.exists()
    discard(sent)
    assert not path.exists()
    discard(sent)  # twice: still a no-op
    discard(np.zeros(3, np.float32))  # not a block
    with pytest.raises(FileNotFoundError):
        sent.take()
