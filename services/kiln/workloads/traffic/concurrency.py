"""Requests in flight, estimated (the traces record arrivals, not completions).

Each request lasts ``isl / prefill_tokens_per_s + osl * tpot_s`` seconds (:class:`ServiceModel`:
unloaded, no queueing or batching slowdown; defaults 8,000 prompt tokens/s and 25 ms per output
token, typical of an 8B-class model on one H100/H200, not measured). The count in flight is swept
exactly (+1 at arrival, -1 at departure) from the first arrival to the last departure; Little's law
is reported beside it as a check. Every number is an estimate; real concurrency under load is
higher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.workloads.traffic.records import Request


@dataclass(frozen=True)
class ServiceModel:
    """Unloaded service time of one request, seconds: ``isl / prefill_tokens_per_s +
    osl * tpot_s``.

    Attributes:
        prefill_tokens_per_s: prompt tokens prefilled per second for one request (tokens/s).
        tpot_s: time per output token during decode (seconds).
    """

    prefill_tokens_per_s: float = 8_000.0
    tpot_s: float = 0.025

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0 or not self.tpot_s >= 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and tpot_s >= 0")

    def duration_s(self, isl: int, osl: int) -> float:
        """Seconds from arrival to the last output token of a request with ``isl`` prompt and
        ``osl`` output tokens."""
        return isl / self.prefill_tokens_per_s + osl * self.tpot_s


@dataclass(frozen=True)
class Concurrency:
    """Requests in flight under a :class:`ServiceModel` (an estimate).

    Attributes:
        mean: time-averaged number in flight over ``window_s`` (requests).
        max: the most in flight at any instant (requests).
        littles_law: arrival rate x mean duration (requests).
        window_s: first arrival to last estimated departure (seconds).
    """

    mean: float
    max: int
    littles_law: float
    window_s: float


def estimate_concurrency(
    requests: Sequence[Request], service: ServiceModel | None = None
) -> Concurrency:
    """Sweep arrivals and estimated departures of ``requests`` (any order).

    Raises:
        ValueError: no requests.
    """
    if not requests:
        raise ValueError("concurrency of no requests")
    model = service or ServiceModel()
    durations = [model.duration_s(r.isl, r.osl) for r in requests]
    # Half-open intervals [arrival, departure): at equal times departures (-1) sort first.
    # Zero-length requests are never in flight and are left out of the sweep.
    events = [(r.arrival_s, 1) for r, d in zip(requests, durations, strict=True) if d > 0]
    events += [(r.arrival_s + d, -1) for r, d in zip(requests, durations, strict=True) if d > 0]
    events.sort()
    start = min(r.arrival_s for r in requests)
    end = max(r.arrival_s + d for r, d in zip(requests, durations, strict=True))
    area = 0.0
    level = peak = 0
    last = start
    for t, step in events:
        area += level * (t - last)
        last = t
        level += step
        peak = max(peak, level)
    window = end - start
    arrivals = sorted(r.arrival_s for r in requests)
    span = arrivals[-1] - arrivals[0]
    rate = (len(arrivals) - 1) / span if span > 0 else 0.0
    return Concurrency(
        mean=area / window if window > 0 else 0.0,
        max=peak,
        littles_law=rate * math.fsum(durations) / len(durations),
        window_s=window,
    )
