"""Timing decode steps: a per-device timer and the summary of its samples (measurements:
docs/design/engine.md, "Timing").

Both timers take ``keep``, a callback that sees each result right after the call and may return
device work to run outside the timed interval (:class:`kiln.runtime.check.TimedOutputs`). CPU:
``time.perf_counter``, bound at engine build, read around the call; ``keep`` runs after. CUDA:
events on the current stream, the end recorded after a device-wide synchronize (work on any stream
counts; the bias is a few µs, about the same for every candidate); ``keep`` is enqueued on the
current stream right after the call and its GPU time is subtracted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.runtime.measurement import Timing

Keep = Callable[[Any], Callable[[], None] | None]
"""Called with a timed call's result right after the call returns (host work only); returns
work to run outside the timed interval (a copy of the result), or None."""


class CpuTimer:
    """Times a call with ``time.perf_counter`` (bound at construction); milliseconds."""

    def __init__(self) -> None:
        self._clock = time.perf_counter

    def time_ms(self, fn: Callable[[], Any], keep: Keep | None = None) -> float:
        """Run ``fn`` once and return its wall time, ms; then ``keep(result)`` and the work it
        returns, untimed."""
        clock = self._clock
        start = clock()
        out = fn()
        ms = (clock() - start) * 1e3
        work = keep(out) if keep is not None else None
        if work is not None:
            work()
        return ms

    def sync(self) -> None:
        """Nothing to wait for on CPU."""


class CudaTimer:
    """Times a call with CUDA events, up to a device-wide synchronize; milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._event = torch.cuda.Event
        self._synchronize = torch.cuda.synchronize

    def time_ms(self, fn: Callable[[], Any], keep: Keep | None = None) -> float:
        """Run ``fn`` once; return the GPU time from an event before it to an event after the
        device went idle (every stream's work counted), less the GPU time of the work
        ``keep(result)`` returns, which is enqueued on the current stream right after the call.
        Synchronizes."""
        event = self._event
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        out = fn()
        work = keep(out) if keep is not None else None
        if work is not None:
            before, after = event(enable_timing=True), event(enable_timing=True)
            before.record()
            work()
            after.record()
        self._synchronize(self.device)
        end.record()
        end.synchronize()
        ms = float(start.elapsed_time(end))
        if work is not None:
            ms -= float(before.elapsed_time(after))
        return ms

    def sync(self) -> None:
        """Wait for the device's queued work."""
        self._synchronize(self.device)


def timer_for(device: torch.device | str) -> CpuTimer | CudaTimer:
    """The timer of ``device``'s type."""
    dev = torch.device(device)
    return CudaTimer(dev) if dev.type == "cuda" else CpuTimer()


def time_after_untimed(
    timer: CpuTimer | CudaTimer, fn: Callable[[], Any], repeats: int, keep: Keep | None = None
) -> list[float]:
    """``fn`` once untimed (lazy initialisation, compilation land there), then ``repeats``
    timed calls with ``timer``: ms each; ``keep`` sees each timed call's result, untimed. How
    the engines time prefill, a candidate's (:meth:`kiln.runtime.engine.Engine._time_prefill`)
    and a baseline's (:func:`kiln.baselines.harness.time_prefill`)."""
    fn()
    return [timer.time_ms(fn, keep) for _ in range(repeats)]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ascending values, linear interpolation; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], warmup_runs: int) -> Timing:
    """Median, p10, p90, sample stdev, mean and max of ``samples_ms`` (ms; all 0 when empty)."""
    ordered = sorted(samples_ms)
    return Timing(
        median_ms=percentile(ordered, 0.5),
        p10_ms=percentile(ordered, 0.1),
        p90_ms=percentile(ordered, 0.9),
        stdev_ms=statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0,
        samples_ms=list(samples_ms),
        warmup_runs=warmup_runs,
        mean_ms=statistics.fmean(samples_ms) if samples_ms else 0.0,
        max_ms=ordered[-1] if ordered else 0.0,
    )
