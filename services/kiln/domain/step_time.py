"""The step time a decode measurement is decided by (rationale: docs/design/engine.md,
"Timing").

A candidate can do the work of every timed step in one of them and answer the others from a
cache, each answer correct: the median then shows only the cheap steps. The *decision step*
is ``max(median, mean / FRONT_LOAD_SLACK)``: a run whose mean is within the slack of its
median is decided by its median, and front-loaded work gains at most ``FRONT_LOAD_SLACK``
times. tokens/s is ``batch / decision step``; the band test's upper end is at least it.
Milliseconds throughout; a mean of 0 (not recorded, e.g. an old event) leaves the median.
"""

from __future__ import annotations

FRONT_LOAD_SLACK = 1.25
"""How far above its median a run's mean may lie before the mean decides."""


def decision_step_ms(median_ms: float, mean_ms: float) -> float:
    """``max(median_ms, mean_ms / FRONT_LOAD_SLACK)``, ms."""
    return max(median_ms, mean_ms / FRONT_LOAD_SLACK)


def band_top_ms(p90_ms: float, median_ms: float, mean_ms: float) -> float:
    """The slow end of a run's p10-p90 band as the band test reads it: the p90 step, raised to
    the decision step (ms)."""
    return max(p90_ms, decision_step_ms(median_ms, mean_ms))
