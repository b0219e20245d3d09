"""The best-so-far curve: one point per ``BestCandidateImproved`` (seconds since the
submission, experiments and engine device seconds spent by then, tokens/s, speedup), and how
soon it got near its end. Events recorded before those fields existed get ``elapsed_s`` from
the ledger's ``recorded_at`` and 0 for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class CurvePoint:
    """The best-so-far after one ``BestCandidateImproved``.

    Attributes:
        elapsed_s: seconds from the submission to the event.
        experiments: experiments completed by then (0 when unknown: older events).
        device_s: engine busy seconds spent by then, all agents (0 when unknown).
        tokens_per_s: the new best's full-tier tokens/s.
        speedup: over the reference measured next to it.
        candidate_id, experiment_id: the new best.
    """

    elapsed_s: float
    experiments: int
    device_s: float
    tokens_per_s: float
    speedup: float
    candidate_id: str
    experiment_id: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form."""
        return asdict(self)


def curve_point(
    data: Mapping[str, Any], recorded_at: datetime, submitted_at: datetime
) -> CurvePoint:
    """A ``BestCandidateImproved`` payload as a point (``elapsed_s`` from the ledger's times when
    the payload has none)."""
    elapsed = float(data.get("elapsed_s") or 0.0)
    if elapsed <= 0:
        elapsed = max(0.0, (recorded_at - submitted_at).total_seconds())
    return CurvePoint(
        elapsed_s=elapsed,
        experiments=int(data.get("experiments") or 0),
        device_s=float(data.get("device_s") or 0.0),
        tokens_per_s=float(data.get("tokens_per_s") or 0.0),
        speedup=float(data.get("speedup") or 0.0),
        candidate_id=str(data.get("candidate_id", "")),
        experiment_id=str(data.get("experiment_id", "")),
    )


def time_to_fraction(points: Sequence[CurvePoint], fraction: float = 0.95) -> float | None:
    """Seconds until the best-so-far first reached ``fraction`` of the final best's tokens/s
    (the last point's), or None without points.

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not points:
        return None
    bar = fraction * points[-1].tokens_per_s
    return next(p.elapsed_s for p in points if p.tokens_per_s >= bar)
