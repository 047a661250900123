"""qasr's C++ kernels release the GIL while they compute: a Python thread (the server's event loop, an
upload's decoder) keeps running while the engine thread is inside a long product. Measured as the longest
pause of a pure-Python loop while another thread calls the kernel back to back: holding the GIL, the
loop stalls for a whole call each time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from qasr.engine.cpu.native import attention_kernel, decode_kernel, linear_kernel

CALL_S = 0.15  # each call is sized to take at least this long, so a held GIL shows as a pause this long


def longest_pause(call: Callable[[], object], seconds: float = 1.5) -> tuple[float, float]:
    """(the longest gap between iterations of a Python loop, the mean kernel call) while ``call`` runs
    back to back in another thread."""
    stop = threading.Event()
    calls: list[float] = []

    def worker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            call()
            calls.append(time.perf_counter() - t)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        while not calls:  # the first call has started and finished: the loop below overlaps the next ones
            time.sleep(0.001)
        longest, last = 0.0, time.perf_counter()
        end = last + seconds
        while last < end:
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
    finally:
        stop.set()
        thread.join()
    return longest, sum(calls) / len(calls)


def sized(make: Callable[[int], Callable[[], object]], start: int, limit: int) -> Callable[[], object]:
    """The call of ``make(n)`` with n doubled from ``start`` until a call takes CALL_S (or n reaches limit).
    A size's first call pays for cold caches and fresh pages (seen taking 2.7x the calls after it, which then
    came out too short to tell), so a size is taken only when a second call also takes CALL_S."""
    n = start
    while True:
        call = make(n)
        if n >= limit or all(_seconds(call) >= CALL_S for _ in range(2)):
            return call
        n *= 2


def _seconds(call: Callable[[], object]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


@pytest.fixture
def one_thread():
    """The kernel on one thread, so the Python loop has a core of its own on a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check(call: Callable[[], object]) -> None:
    pause, per_call = longest_pause(call)
    assert per_call >= CALL_S / 2, f"calls too short to tell ({per_call * 1e3:.0f} ms)"
    # released: the loop pauses only for scheduling (milliseconds); held: for a whole call
    assert pause < per_call / 2, f"a Python thread stalled {pause * 1e3:.0f} ms during {per_call * 1e3:.0f} ms calls"


@pytest.mark.skipif(linear_kernel() is None, reason="no native bf16 GEMM on this CPU")
def test_the_gemm_releases_the_gil(one_thread) -> None:
    kernel = linear_kernel()
    w = kernel.pack(torch.randn(2048, 2048).bfloat16())

    def make(m: int) -> Callable[[], object]:
        x = torch.randn(m, 2048).bfloat16()
        return lambda: kernel.linear(x, w, 2048, None)

    check(sized(make, 64, 1 << 15))


@pytest.mark.skipif(attention_kernel() is None, reason="no native prefill attention on this CPU")
def test_the_prefill_attention_releases_the_gil(one_thread) -> None:
    kernel = attention_kernel()
    kv_heads, heads, dim, bs = 8, 16, 128, 16

    def make(n: int) -> Callable[[], object]:
        ctx = 1024
        blocks = -(-(ctx + n) // bs)
        kpool = torch.randn(kv_heads, blocks * bs, dim).bfloat16()
        vpool = torch.randn(kv_heads, blocks * bs, dim).bfloat16()
        q = torch.randn(n, heads, dim).bfloat16()
        return lambda: kernel.prefill_attention(q, kpool, vpool, torch.arange(blocks), bs, ctx, dim ** -0.5)

    check(sized(make, 256, 1 << 14))


@pytest.mark.slow
@pytest.mark.skipif(decode_kernel() is None, reason="no native decode attention")
def test_the_decode_attention_releases_the_gil(one_thread) -> None:
    kernel = decode_kernel()
    kv_heads, heads, dim, bs = 8, 16, 128, 16

    def make(ctx: int) -> Callable[[], object]:
        batch = 8
        blocks = batch * (-(-ctx // bs))
        # drawn in bf16 directly: a float32 draw then a copy held two more pools of up to 2 GB each
        kpool = torch.randn(kv_heads, blocks * bs, dim, dtype=torch.bfloat16)
        vpool = torch.randn(kv_heads, blocks * bs, dim, dtype=torch.bfloat16)
        tables = torch.arange(blocks).view(batch, -1)
        lens = torch.full((batch,), ctx)
        q = torch.randn(batch, heads, dim).bfloat16()
        return lambda: kernel.decode_attention(q, kpool, vpool, tables, lens, bs, dim ** -0.5)

    check(sized(make, 4096, 1 << 19))
