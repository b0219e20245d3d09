"""The measured-pass tier's math: a decode-step estimate calibrated against engine measurements.

Evidence is pairs (measured step ms, predicted step ms) of one (model, hardware) at the
operating points the engines measured. The calibration is one factor ``f``, the geometric
mean of measured / predicted (least squares in log space, so a 2x miss counts as much as a
0.5x one); it multiplies the step's device time (not its communication, which no single-device
engine measured). Reported: ``error_before`` and ``residual``, the median of ``|f x predicted /
measured - 1|`` before (f = 1) and after; and, from three points on, ``holdout``: the same median
with each point predicted by the factor of the others (leave-one-out), the honest estimate of
the error at an operating point not yet measured. Pure functions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_POINTS = 1
"""Points a calibration needs."""


@dataclass(frozen=True)
class Calibration:
    """A fitted factor and its errors (fractions); ``holdout`` None below three points."""

    factor: float
    points: int
    error_before: float
    residual: float
    holdout: float | None

    def describe(self) -> str:
        """One line for Explain."""
        hold = f", leave-one-out {self.holdout:.1%}" if self.holdout is not None else ""
        return (
            f"x{self.factor:.4g} from {self.points} measured pass(es); median error "
            f"{self.error_before:.1%} before, residual {self.residual:.1%} after{hold}"
        )


def _factor(pairs: Sequence[tuple[float, float]]) -> float:
    return math.exp(statistics.fmean(math.log(m / p) for m, p in pairs))


def _median_error(pairs: Sequence[tuple[float, float]], factor: float) -> float:
    return statistics.median(abs(factor * p / m - 1.0) for m, p in pairs)


def fit(pairs: Sequence[tuple[float, float]]) -> Calibration | None:
    """The calibration of (measured, predicted) pairs (ms); None when fewer than
    :data:`MIN_POINTS` usable ones (both positive and finite)."""
    good = [(m, p) for m, p in pairs if m > 0 and p > 0 and math.isfinite(m) and math.isfinite(p)]
    if len(good) < MIN_POINTS:
        return None
    f = _factor(good)
    holdout = None
    if len(good) >= 3:
        errs = []
        for i, (m, p) in enumerate(good):
            rest = good[:i] + good[i + 1 :]
            errs.append(abs(_factor(rest) * p / m - 1.0))
        holdout = statistics.median(errs)
    return Calibration(f, len(good), _median_error(good, 1.0), _median_error(good, f), holdout)
