"""Device parameters for tests that run on CPU everywhere and on CUDA where a GPU is present.

On a machine without a GPU the CUDA cases are skipped with the reason below; `scripts/gpu_check.sh` runs
them (`pytest -k cuda`) on a lent GPU machine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

NO_CUDA = "no CUDA device here: the CUDA cases run on a GPU machine via scripts/gpu_check.sh"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@contextmanager
def exact_float32() -> Iterator[None]:
    """float32 on CUDA without TF32 (cuDNN convolutions use it by default), restored afterwards."""
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
