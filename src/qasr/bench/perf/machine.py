"""What this machine can do right now: CPU model, best bf16 and int8 GEMM rates, read bandwidth.
A benchmark measures them at its start and reports against them (docs/log: bench-machine-drift)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """CPU model name and the bf16 matrix features."""
    model, flags = "unknown", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return dict(model=model, amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags)


class ForeignCpu:
    """CPU seconds other processes used while the block ran, and their CPU share (Linux only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.share = 0.0
        self._start = (0.0, 0.0, 0.0)

    def __enter__(self) -> ForeignCpu:
        self._start = _cpu_snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = (b - a for a, b in zip(self._start, _cpu_snapshot(), strict=True))
        self.seconds = max(0.0, busy - own)
        self.share = self.seconds / max(wall * (os.cpu_count() or 1), 1e-9)


def _cpu_snapshot() -> tuple[float, float, float]:
    busy = 0.0
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return busy, t.user + t.system if busy else 0.0, time.perf_counter()


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rates(m: int, k: int, n: int, kernels: dict[str, object], repeats: int) -> dict[str, float]:
    """FLOP/s of an (m x k) @ (k x n) bf16 product by F.linear ("torch") and each module in ``kernels``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    flop = 2.0 * m * k * n
    rates = {"torch": flop / best_seconds(lambda: F.linear(x, w), repeats)}
    for name, mod in kernels.items():
        packed = mod.pack(w)  # type: ignore[attr-defined]
        rates[name] = flop / best_seconds(lambda: mod.linear(x, packed, n, None), repeats)  # type: ignore[attr-defined]  # noqa: B023
    return rates


def gemm_peak(m: int = 1024, k: int = 1024, n: int = 3072, repeats: int = 10) -> dict:
    """Best bf16 GEMM FLOP/s by torch and by qasr's kernel; the larger is the peak."""
    from qasr.engine.cpu.native import linear_kernel

    kernel = linear_kernel() if k % 2 == 0 else None
    rates = gemm_rates(m, k, n, {"native": kernel} if kernel is not None else {}, repeats)
    best = max(rates, key=rates.__getitem__)
    return dict(shape=[m, k, n], flops=rates, best_flops=rates[best], best_kernel=best)


def int8_peak(m: int = 1024, k: int = 1024, n: int = 3072, repeats: int = 10) -> dict | None:
    """Best ops/s of the W8A8 product (m x k) @ (k x n) by qasr's int8 module; None where there is none."""
    from qasr.engine.cpu.native import int8_kernel

    mod = int8_kernel()
    if mod is None:
        return None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(n, generator=gen) * 0.01
    packed = mod.pack(w_q)  # type: ignore[attr-defined]
    seconds = best_seconds(lambda: mod.linear(x, packed, n, w_scale, None), repeats)  # type: ignore[attr-defined]
    return dict(shape=[m, k, n], ops=2.0 * m * k * n / seconds, kernel=getattr(mod, "KIND", "int8"))


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over a buffer far larger than the caches."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)  # ones, not empty: every page is touched
    seconds = best_seconds(lambda: buf.sum(), repeats)
    return buf.numel() * 4 / seconds


def probe(gemm_shape: tuple[int, int, int] = (1024, 1024, 3072), bandwidth_bytes: int = 1 << 30) -> dict:
    """Everything a benchmark header needs."""
    m, k, n = gemm_shape
    with torch.inference_mode():
        gemm = gemm_peak(m, k, n)
        int8 = int8_peak(m, k, n)
        bw = read_bandwidth(bandwidth_bytes)
    return dict(cpu=cpu_info(), threads=torch.get_num_threads(), gemm=gemm, peak_flops=gemm["best_flops"],
                int8_gemm=int8, int8_peak_ops=int8["ops"] if int8 else None, bandwidth_Bps=bw,
                load_avg_1min=os.getloadavg()[0])
