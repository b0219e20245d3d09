"""Timing decode steps: a per-device timer and the summary of its samples.

CPU steps are timed with ``time.perf_counter`` around the call (CPU ops are synchronous).
CUDA steps are timed with CUDA events recorded around the call and read after a synchronize,
so queued kernels are counted and host overhead between steps is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.engine_pool.measurement import Timing


class CpuTimer:
    """Times a call with ``time.perf_counter``; milliseconds."""

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` once and return its wall time, ms."""
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def sync(self) -> None:
        """Nothing to wait for on CPU."""


class CudaTimer:
    """Times a call with CUDA events on the current stream; milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` once; return the GPU time between events around it, ms (synchronizes)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        """Wait for the device's queued work."""
        torch.cuda.synchronize(self.device)


def timer_for(device: torch.device | str) -> CpuTimer | CudaTimer:
    """The timer of ``device``'s type."""
    dev = torch.device(device)
    return CudaTimer(dev) if dev.type == "cuda" else CpuTimer()


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ascending values, linear interpolation; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], warmup_runs: int) -> Timing:
    """Median, p10, p90 and sample stdev of ``samples_ms`` (ms)."""
    ordered = sorted(samples_ms)
    return Timing(
        median_ms=percentile(ordered, 0.5),
        p10_ms=percentile(ordered, 0.1),
        p90_ms=percentile(ordered, 0.9),
        stdev_ms=statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0,
        samples_ms=list(samples_ms),
        warmup_runs=warmup_runs,
    )
