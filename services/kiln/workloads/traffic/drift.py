"""Drift: how far a traffic window's shape is from the shape the active candidate was proven for,
and the detector that turns a stream of such distances into recompilation triggers.

The statistic, per dimension (``DIMENSIONS``; each >= 0, 0 = no change):

- ``isl``, ``osl``: the absolute *median signed log ratio* over the summary points both shapes
  carry, ``|median_q ln((q_new + 1) / (q_old + 1))|`` for q in p50, p90, p99, mean (nats: e^x
  is the factor the distribution moved by; +1 keeps 0-token outputs finite; the median of four
  is the mean of the middle two). A uniform scaling by f gives ln f in every term (ISL x1.8:
  0.59). Robust to one summary point jumping on its own, which stationary traffic does: the
  Azure conversation trace reshuffles its mixture of short and long prompts (and of prompts at
  its ~4.1k-token cap) from one 10-minute window to the next, so its p50 falls x0.43 for 15
  minutes while p90 rises x1.5, or p90 falls x0.5 alone; the largest |term| reaches 0.84 and
  their mean 0.27 with no drift, their median 0.20. A real shift moves most terms one way. Each
  term is reported in ``observed``.
- ``batch``, ``context``: ``|ln(new / old)|`` of the operating point's decode batch (floored at
  ``MIN_BATCH``) and context tokens (:mod:`kiln.domain.operating_point`; nats). Context comes
  from the ISL p50 and so inherits its mixture noise; its limit is loose and ISL carries prompt
  growth.
- ``arrival_rate``: ``|ln(new / old)|`` of requests/s (rates floored at 1e-3 rps; nats).
- ``burstiness``: ``|ln((1 + cv_new) / (1 + cv_old))|`` of the interarrival CV: a difference
  while traffic is smooth (CV 0 -> 1 is 0.69), a ratio once it is bursty (Azure code's windows
  range over CV 9..17 around 13: a plain difference would be 4, this is 0.3).
- ``prefix_reuse``: ``|hit_new - hit_old|`` of the token-weighted prefix-cache hit rate
  (a fraction; 0.1 = ten points).
- ``expert_skew``: ``|s_new - s_old|`` of the expert-load Zipf exponent (a pure number).

Hit rate, Zipf exponent and CV depend on the sample's size (a window's cache starts cold), so
the proven shape to compare windows with is :func:`reference_shape` of the proven requests,
which takes those three from the median window. ``normalized`` divides each statistic by its
limit (``DriftPolicy.<dim>_limit``); ``score`` is the largest; a window is drifted at
``score >= threshold``. The defaults come from ``benchmarks/drift_scenarios.py`` on the real
traces (numbers: docs/design/deployments.md, "Drift"). Stdlib only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.shape import TrafficShape
from kiln.workloads.traffic.stats import Distribution
from kiln.workloads.traffic.windows import WindowSpec, fold

DIMENSIONS = (
    "isl",
    "osl",
    "batch",
    "context",
    "arrival_rate",
    "burstiness",
    "prefix_reuse",
    "expert_skew",
)
QUANTILES = ("p50", "p90", "p99", "mean")
"""The distribution summary points the ISL/OSL statistic takes the median over."""
MIN_BATCH = 4.0
"""Batches are floored here before their log ratio: decode at 1..4 sequences reads the same
weights in about the same time, and a bursty trace's windows swing between batch 1 and 3."""
MIN_RATE_RPS = 1e-3
"""Arrival rates are floored here before their log ratio (a one-request window has rate 0)."""


@dataclass(frozen=True)
class DriftPolicy:
    """When drift triggers a recompilation.

    Attributes:
        threshold: normalized score at or above which a window counts as drifted (1.0: some
            dimension is at its limit).
        release: score below which the detector re-arms after a trigger (hysteresis;
            ``0 <= release < threshold``).
        consecutive: drifted windows in a row needed to trigger (sparse windows are skipped:
            they neither count nor break a run).
        cooldown_s: arrival-time seconds after a trigger (or a rebase) during which none fires.
        predicted_drop: a window also counts as drifted when the caller's cost model predicts
            the active candidate's tokens/s fell by more than this fraction (0 < x <= 1).
        <dimension>_limit: the statistic (module docstring) that normalizes to 1.0 (> 0).

    Raises:
        ValueError: any value outside the ranges above, or not a finite number.
    """

    threshold: float = 1.0
    release: float = 0.6
    consecutive: int = 2
    cooldown_s: float = 1800.0
    predicted_drop: float = 0.15
    isl_limit: float = 0.3
    osl_limit: float = 0.35
    batch_limit: float = 0.8
    context_limit: float = 1.0
    arrival_rate_limit: float = 1.3
    burstiness_limit: float = 0.5
    prefix_reuse_limit: float = 0.15
    expert_skew_limit: float = 0.3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "consecutive":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"drift policy consecutive must be an integer >= 1, got {value!r}"
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"drift policy {f.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"drift policy {f.name} must be finite, got {value!r}")
            if f.name.endswith("_limit") and value <= 0:
                raise ValueError(f"drift policy {f.name} must be > 0, got {value:g}")
        if self.threshold <= 0:
            raise ValueError(f"drift policy threshold must be > 0, got {self.threshold:g}")
        if not 0 <= self.release < self.threshold:
            raise ValueError(
                f"drift policy release must be within 0 <= release < threshold = "
                f"{self.threshold:g}, got {self.release:g}"
            )
        if self.cooldown_s < 0:
            raise ValueError(f"drift policy cooldown_s must be >= 0, got {self.cooldown_s:g}")
        if not 0 < self.predicted_drop <= 1:
            raise ValueError(
                "drift policy predicted_drop must be within 0 < x <= 1, "
                f"got {self.predicted_drop:g}"
            )

    def limit(self, dimension: str) -> float:
        """The limit of one of ``DIMENSIONS``; KeyError for another name."""
        if dimension not in DIMENSIONS:
            raise KeyError(dimension)
        return float(getattr(self, f"{dimension}_limit"))

    def to_dict(self) -> dict[str, float | int]:
        """Every field by name (JSON-ready)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DriftPolicy:
        """A policy from :meth:`to_dict`'s keys (missing keys take the defaults; integral floats
        are accepted for ``consecutive``). ValueError for an unknown key or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown drift policy field(s) {', '.join(map(str, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        values = dict(d)
        c = values.get("consecutive")
        if isinstance(c, float) and c.is_integer():
            values["consecutive"] = int(c)
        return cls(**values)


@dataclass(frozen=True)
class DriftMeasure:
    """One window's distance from the proven shape.

    Attributes:
        dimensions: each of ``DIMENSIONS``' statistic (module docstring; units there).
        normalized: statistic / its policy limit (1.0 = at the limit).
        score: the largest normalized value.
        dominant: the dimension giving the score (the first in ``DIMENSIONS`` order on a tie).
        observed: per dimension the numbers behind it, for people: ``proven`` and ``window``
            values (ISL/OSL: per quantile, and each quantile's signed log ratio ``d_<q>``).
    """

    dimensions: dict[str, float]
    normalized: dict[str, float]
    score: float
    dominant: str
    observed: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields above by name."""
        return {
            "dimensions": dict(self.dimensions),
            "normalized": dict(self.normalized),
            "score": self.score,
            "dominant": self.dominant,
            "observed": {k: dict(v) for k, v in self.observed.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DriftMeasure:
        """The measure :meth:`to_dict` wrote (KeyError / ValueError on a malformed one)."""
        return cls(
            dimensions={str(k): float(v) for k, v in d["dimensions"].items()},
            normalized={str(k): float(v) for k, v in d["normalized"].items()},
            score=float(d["score"]),
            dominant=str(d["dominant"]),
            observed={
                str(k): {str(a): float(b) for a, b in v.items()}
                for k, v in (d.get("observed") or {}).items()
            },
        )

    def summary(self) -> str:
        """One line: the score and the dominant dimension's statistic against its limit."""
        dim = self.dominant
        return (
            f"score {self.score:.2f}: {dim} {self.dimensions[dim]:.3g} "
            f"({self.normalized[dim]:.2f} x its limit)"
        )


def _log_ratio(new: float, old: float) -> float:
    return math.log(new / old)


def _distribution(old: Distribution, new: Distribution) -> tuple[float, dict[str, float]]:
    seen: dict[str, float] = {}
    terms = []
    for q in QUANTILES:
        a, b = float(getattr(old, q)), float(getattr(new, q))
        d = _log_ratio(b + 1.0, a + 1.0)
        terms.append(d)
        seen[f"{q}_proven"], seen[f"{q}_window"], seen[f"d_{q}"] = a, b, d
    return abs(statistics.median(terms)), seen


def statistics_of(proven: TrafficShape, window: TrafficShape) -> tuple[dict[str, float], dict]:
    """Each dimension's statistic (module docstring) and the numbers behind it."""
    stats: dict[str, float] = {}
    observed: dict[str, dict[str, float]] = {}
    stats["isl"], observed["isl"] = _distribution(proven.isl_tokens, window.isl_tokens)
    stats["osl"], observed["osl"] = _distribution(proven.osl_tokens, window.osl_tokens)
    pairs = {
        "batch": (float(proven.batch_size), float(window.batch_size)),
        "context": (float(proven.context_len), float(window.context_len)),
        "arrival_rate": (proven.arrival_rate_rps, window.arrival_rate_rps),
        "burstiness": (proven.interarrival_cv, window.interarrival_cv),
        "prefix_reuse": (proven.prefix_hit_rate, window.prefix_hit_rate),
        "expert_skew": (proven.expert_zipf_exponent, window.expert_zipf_exponent),
    }
    for dim, (a, b) in pairs.items():
        observed[dim] = {"proven": a, "window": b}
    a, b = pairs["batch"]
    stats["batch"] = abs(_log_ratio(max(b, MIN_BATCH), max(a, MIN_BATCH)))
    stats["context"] = abs(_log_ratio(max(pairs["context"][1], 1.0), max(pairs["context"][0], 1.0)))
    a, b = pairs["arrival_rate"]
    stats["arrival_rate"] = abs(_log_ratio(max(b, MIN_RATE_RPS), max(a, MIN_RATE_RPS)))
    a, b = pairs["burstiness"]
    stats["burstiness"] = abs(_log_ratio(1.0 + b, 1.0 + a))
    a, b = pairs["prefix_reuse"]
    stats["prefix_reuse"] = abs(b - a)
    a, b = pairs["expert_skew"]
    stats["expert_skew"] = abs(b - a)
    return stats, observed


def measure_drift(proven: TrafficShape, window: TrafficShape, policy: DriftPolicy) -> DriftMeasure:
    """How far ``window`` is from ``proven`` (statistics: module docstring), normalized by
    ``policy``'s limits."""
    stats, observed = statistics_of(proven, window)
    normalized = {dim: stats[dim] / policy.limit(dim) for dim in DIMENSIONS}
    dominant = max(DIMENSIONS, key=lambda dim: normalized[dim])
    return DriftMeasure(
        dimensions={dim: stats[dim] for dim in DIMENSIONS},
        normalized=normalized,
        score=normalized[dominant],
        dominant=dominant,
        observed=observed,
    )


def reference_shape(
    requests: Sequence[Request], spec: WindowSpec | None = None, *, source: str = "reference"
) -> TrafficShape:
    """The proven shape to measure windows against: ``TrafficShape.from_requests(requests)``
    with the three size-dependent numbers (interarrival CV, prefix hit rate, expert Zipf
    exponent) replaced by their medians over ``requests``' non-sparse windows under ``spec``
    (default :class:`WindowSpec`), so a stationary window scores ~0. With no non-sparse
    window the whole-trace numbers stay. ValueError: no requests."""
    whole = TrafficShape.from_requests(requests, source=source)
    shapes = [w.shape() for w in fold(list(requests), spec or WindowSpec()) if not w.sparse]
    if not shapes:
        return whole
    return replace(
        whole,
        interarrival_cv=statistics.median(s.interarrival_cv for s in shapes),
        prefix_hit_rate=statistics.median(s.prefix_hit_rate for s in shapes),
        expert_zipf_exponent=statistics.median(s.expert_zipf_exponent for s in shapes),
        notes=(
            *whole.notes,
            f"interarrival_cv, prefix_hit_rate, expert_zipf_exponent: medians over "
            f"{len(shapes)} windows (kiln.workloads.traffic.drift.reference_shape)",
        ),
    )


@dataclass(frozen=True)
class Decision:
    """What the detector made of one window.

    Attributes:
        drifted: this window counts as drifted (score >= threshold or a predicted drop beyond
            the policy's, and not sparse).
        triggered: a recompilation should start now.
        reason: one line for people: why (or why not: "cooling down until ...").
        consecutive: drifted windows in a row so far (at a trigger: the run that fired).
        score, dominant: the measure's.
        armed: whether the detector can trigger on the next drifted run (after this window).
        cooldown_until_s: arrival time before which nothing fires (None: no cooldown yet).
        predicted_drop: the caller's predicted fractional tokens/s drop (None: not given).
    """

    drifted: bool
    triggered: bool
    reason: str
    consecutive: int
    score: float = 0.0
    dominant: str = ""
    armed: bool = True
    cooldown_until_s: float | None = None
    predicted_drop: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields above by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class DetectorState:
    """Everything a :class:`DriftDetector` remembers (equal after equal histories)."""

    armed: bool = True
    run: int = 0
    cooldown_until_s: float | None = None
    last_trigger_s: float | None = None
    windows: int = 0
    triggers: int = 0


class DriftDetector:
    """Hysteresis + cooldown over a stream of windows; a pure fold: rebuilding it by observing the
    same windows again (and the same rebases, in order) gives the same state (that is how the
    controller recovers).

    Rules, per observed window: a sparse one changes nothing. Otherwise it is drifted at
    ``score >= threshold`` or ``predicted_drop > policy.predicted_drop``; a drifted window
    extends the run, any other ends it. An armed detector triggers when the run reaches
    ``consecutive`` and ``window_end_s >= cooldown_until_s``; a trigger disarms it and starts
    the cooldown. It re-arms at a non-drifted window whose score is below ``release``, or at
    :meth:`rebase`.
    """

    def __init__(self, policy: DriftPolicy) -> None:
        self.policy = policy
        self.state = DetectorState()

    def observe(
        self,
        measure: DriftMeasure,
        window_end_s: float,
        *,
        sparse: bool = False,
        predicted_drop: float | None = None,
    ) -> Decision:
        """Fold one window (``window_end_s``: its end, arrival seconds) and decide."""
        p, s = self.policy, self.state
        score = measure.score

        def decide(drifted: bool, triggered: bool, reason: str, run: int | None = None) -> Decision:
            t = self.state
            return Decision(
                drifted=drifted,
                triggered=triggered,
                reason=reason,
                consecutive=t.run if run is None else run,
                score=score,
                dominant=measure.dominant,
                armed=t.armed,
                cooldown_until_s=t.cooldown_until_s,
                predicted_drop=predicted_drop,
            )

        if sparse:
            self.state = replace(s, windows=s.windows + 1)
            return decide(False, False, f"sparse window: not counted (score {score:.2f})")
        dropped = predicted_drop is not None and predicted_drop > p.predicted_drop
        over = score >= p.threshold
        if not (over or dropped):
            armed = s.armed or score < p.release
            if not s.armed and armed:
                why = f"re-armed: score {score:.2f} below release {p.release:g}"
            elif not armed:
                why = (
                    f"score {score:.2f} below threshold {p.threshold:g}; re-arms below "
                    f"release {p.release:g}"
                )
            else:
                why = f"score {score:.2f} below threshold {p.threshold:g}"
            self.state = replace(s, armed=armed, run=0, windows=s.windows + 1)
            return decide(False, False, why)
        run = s.run + 1
        what = _what(measure, p, predicted_drop if dropped else None)
        if not s.armed:
            self.state = replace(s, run=run, windows=s.windows + 1)
            why = f"{what}; not re-armed since the last trigger (needs score < {p.release:g})"
            return decide(True, False, why)
        if run < p.consecutive:
            self.state = replace(s, run=run, windows=s.windows + 1)
            why = f"{what}; drifted window {run} of {p.consecutive} needed in a row"
            return decide(True, False, why)
        if s.cooldown_until_s is not None and window_end_s < s.cooldown_until_s:
            self.state = replace(s, run=run, windows=s.windows + 1)
            why = f"{what}; cooling down until {s.cooldown_until_s:.1f} s"
            return decide(True, False, why)
        self.state = replace(
            s,
            armed=False,
            run=0,
            cooldown_until_s=window_end_s + p.cooldown_s,
            last_trigger_s=window_end_s,
            windows=s.windows + 1,
            triggers=s.triggers + 1,
        )
        why = f"{what}; {run} drifted windows in a row: recompile"
        return decide(True, True, why, run)

    def rebase(self, window_end_s: float) -> None:
        """The proven shape changed (promotion or decline at the new shape): clear the run,
        re-arm, start the cooldown at ``window_end_s``."""
        s = self.state
        self.state = replace(
            s, armed=True, run=0, cooldown_until_s=window_end_s + self.policy.cooldown_s
        )


def _what(measure: DriftMeasure, policy: DriftPolicy, dropped: float | None) -> str:
    parts = []
    if measure.score >= policy.threshold:
        parts.append(f"drift {measure.summary()}")
    if dropped is not None:
        parts.append(
            f"cost model predicts tokens/s -{dropped:.0%} (beyond {policy.predicted_drop:.0%})"
        )
    return " and ".join(parts)
