"""Summary statistics over plain sequences, without numpy.

Percentiles use numpy's default (``method="linear"``, Hyndman & Fan type 7): for sorted values
``x[0..n-1]`` and quantile ``q``, ``h = (n - 1) q`` and the result is
``x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h])``. The same as
``statistics.quantiles(method="inclusive")``, and what SOURCES.md's figures were computed with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (``0 <= q <= 1``) of already sorted values, linearly interpolated.

    Raises:
        ValueError: no values, or ``q`` outside [0, 1].
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    h = (len(sorted_values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    x_lo = float(sorted_values[lo])
    return x_lo + (h - lo) * (float(sorted_values[hi]) - x_lo)


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over mean (numpy's ``std / mean``, ``ddof=0``); 0.0 when
    the mean is 0 or there are no values."""
    if not values:
        return 0.0
    mean = math.fsum(values) / len(values)
    if mean == 0.0:
        return 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


@dataclass(frozen=True)
class Distribution:
    """Summary of a distribution (tokens or seconds, as the field using it says): the 50th, 90th
    and 99th percentiles, the mean and the maximum. Mirrors ``kiln.v1.Distribution``."""

    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """The summary of ``values`` (any order).

        Raises:
            ValueError: no values.
        """
        if not values:
            raise ValueError("distribution of no values")
        xs = sorted(values)
        return cls(
            p50=percentile(xs, 0.50),
            p90=percentile(xs, 0.90),
            p99=percentile(xs, 0.99),
            mean=math.fsum(xs) / len(xs),
            max=float(xs[-1]),
        )
