"""Drift statistic per dimension, the detector's hysteresis / consecutive / cooldown / sparse
rules, rebuild by replay, policy validation, and the default policy on the real Azure trace."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.workloads.traffic import read_trace
from kiln.workloads.traffic.drift import (
    DIMENSIONS,
    DriftDetector,
    DriftMeasure,
    DriftPolicy,
    measure_drift,
    reference_shape,
)
from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.shape import TrafficShape
from kiln.workloads.traffic.stats import Distribution
from kiln.workloads.traffic.windows import WindowSpec, fold

AZURE_CONV = Path(__file__).resolve().parents[3] / "shared/data/traces/azure_llm_2023_conv.csv"
POLICY = DriftPolicy()


def _dist(p50: float, p90: float, p99: float, mean: float) -> Distribution:
    return Distribution(p50=p50, p90=p90, p99=p99, mean=mean, max=p99)


BASE = TrafficShape(
    source="base",
    isl_tokens=_dist(1000, 3000, 4000, 1200),
    osl_tokens=_dist(100, 400, 600, 200),
    arrival_rate_rps=5.0,
    interarrival_cv=1.0,
    mean_concurrency=30.0,
    prefix_hit_rate=0.3,
    expert_zipf_exponent=0.2,
    batch_size=30,
    context_len=1050,
)


def _measure(score: float) -> DriftMeasure:
    dims = dict.fromkeys(DIMENSIONS, 0.0)
    dims["isl"] = score * POLICY.isl_limit
    return DriftMeasure(dims, {d: v / POLICY.limit(d) for d, v in dims.items()}, score, "isl")


# ---------------------------------------------------------------------------- the statistic
def test_identical_shapes_do_not_drift() -> None:
    m = measure_drift(BASE, BASE, POLICY)
    assert m.score == 0.0
    assert set(m.dimensions) == set(DIMENSIONS) == set(m.normalized)


def test_isl_scaling_is_its_log_factor_and_one_jumping_quantile_is_not() -> None:
    d = BASE.isl_tokens
    scaled = replace(BASE, isl_tokens=_dist(d.p50 * 1.8, d.p90 * 1.8, d.p99 * 1.8, d.mean * 1.8))
    m = measure_drift(BASE, scaled, POLICY)
    assert m.dominant == "isl"
    assert m.dimensions["isl"] == pytest.approx(math.log(1.8), abs=0.01)
    assert m.normalized["isl"] == pytest.approx(m.dimensions["isl"] / POLICY.isl_limit)
    assert m.observed["isl"]["p90_window"] == pytest.approx(5400)
    # a mixture reshuffle: p50 halves alone -> the median of the four terms barely moves
    reshuffled = replace(BASE, isl_tokens=_dist(d.p50 / 2, d.p90, d.p99, d.mean))
    assert measure_drift(BASE, reshuffled, POLICY).dimensions["isl"] < 0.01
    shorter = replace(BASE, osl_tokens=_dist(13, 55, 250, 28))
    assert measure_drift(BASE, shorter, POLICY).dimensions["osl"] == pytest.approx(
        abs((math.log(56 / 401) + math.log(29 / 201)) / 2)  # the middle two of four terms
    )


@pytest.mark.parametrize(
    ("change", "dimension", "expected"),
    [
        ({"batch_size": 60}, "batch", math.log(2)),
        ({"batch_size": 2}, "batch", math.log(30 / 4)),  # floored at 4
        ({"context_len": 2100}, "context", math.log(2)),
        ({"arrival_rate_rps": 2.5}, "arrival_rate", math.log(2)),
        ({"arrival_rate_rps": 0.0}, "arrival_rate", math.log(5.0 / 1e-3)),
        ({"interarrival_cv": 3.0}, "burstiness", math.log(4 / 2)),
        ({"prefix_hit_rate": 0.65}, "prefix_reuse", 0.35),
        ({"expert_zipf_exponent": 0.0}, "expert_skew", 0.2),
    ],
)
def test_each_dimension(change: dict, dimension: str, expected: float) -> None:
    m = measure_drift(BASE, replace(BASE, **change), POLICY)
    assert m.dimensions[dimension] == pytest.approx(expected)
    assert m.dominant == dimension
    assert m.score == pytest.approx(expected / POLICY.limit(dimension))
    others = [d for d in DIMENSIONS if d != dimension]
    assert all(m.dimensions[d] == 0.0 for d in others)


def test_measure_round_trips_through_a_dict() -> None:
    m = measure_drift(BASE, replace(BASE, interarrival_cv=5.0), POLICY)
    assert DriftMeasure.from_dict(m.to_dict()) == m
    assert "burstiness" in m.summary()


# ---------------------------------------------------------------------------- the policy
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"release": 1.0}, "release"),
        ({"release": -0.1}, "release"),
        ({"threshold": 0.0}, "threshold"),
        ({"consecutive": 0}, "consecutive"),
        ({"consecutive": 1.5}, "consecutive"),
        ({"cooldown_s": -1.0}, "cooldown_s"),
        ({"predicted_drop": 0.0}, "predicted_drop"),
        ({"predicted_drop": 1.5}, "predicted_drop"),
        ({"isl_limit": 0.0}, "isl_limit"),
        ({"osl_limit": float("nan")}, "finite"),
        ({"batch_limit": "big"}, "number"),
        ({"bogus": 1.0}, "unknown drift policy field"),
    ],
)
def test_policy_validation(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DriftPolicy.from_dict(fields)


def test_policy_round_trips_through_a_dict() -> None:
    p = DriftPolicy(threshold=2.0, release=1.0, consecutive=3, isl_limit=0.5)
    assert DriftPolicy.from_dict(p.to_dict()) == p
    assert DriftPolicy.from_dict({"consecutive": 3.0}).consecutive == 3
    with pytest.raises(KeyError):
        p.limit("colour")


# ---------------------------------------------------------------------------- the detector
def _feed(det: DriftDetector, scores: list[float], step: float = 300.0) -> list[bool]:
    return [det.observe(_measure(s), (i + 1) * step).triggered for i, s in enumerate(scores)]


def test_consecutive_drifted_windows_are_needed() -> None:
    det = DriftDetector(DriftPolicy(consecutive=3, cooldown_s=0.0))
    assert _feed(det, [1.5, 1.5, 0.5, 1.5, 1.5, 1.5]) == [False] * 5 + [True]
    d = det.observe(_measure(1.5), 9e9)
    assert d.drifted and not d.triggered and not d.armed


def test_a_score_oscillating_around_the_threshold_triggers_once() -> None:
    det = DriftDetector(DriftPolicy(consecutive=1, cooldown_s=0.0, release=0.6))
    scores = [1.05, 0.95] * 10
    assert sum(_feed(det, scores)) == 1
    # falling below release re-arms it
    d = det.observe(_measure(0.3), 1e6)
    assert d.armed and "re-armed" in d.reason
    assert det.observe(_measure(1.2), 1e6 + 300).triggered


def test_cooldown_holds_a_trigger_back_until_it_ends() -> None:
    det = DriftDetector(DriftPolicy(consecutive=2, cooldown_s=1000.0))
    det.rebase(0.0)  # a promotion at t = 0: nothing fires before t = 1000
    decisions = [det.observe(_measure(2.0), t) for t in (300.0, 600.0, 900.0, 1200.0)]
    assert [d.triggered for d in decisions] == [False, False, False, True]
    assert "cooling down until 1000.0" in decisions[2].reason
    assert decisions[3].consecutive == 4
    assert det.state.cooldown_until_s == 2200.0


def test_sparse_windows_never_count_nor_break_a_run() -> None:
    det = DriftDetector(DriftPolicy(consecutive=2, cooldown_s=0.0))
    d = det.observe(_measure(5.0), 300.0, sparse=True)
    assert not d.drifted and not d.triggered and d.consecutive == 0
    assert not det.observe(_measure(5.0), 600.0).triggered
    assert not det.observe(_measure(5.0), 900.0, sparse=True).drifted
    assert det.observe(_measure(5.0), 1200.0).triggered


def test_predicted_drop_counts_as_drift() -> None:
    det = DriftDetector(DriftPolicy(consecutive=1, predicted_drop=0.15))
    assert not det.observe(_measure(0.1), 300.0, predicted_drop=0.1).drifted
    d = det.observe(_measure(0.1), 600.0, predicted_drop=0.2)
    assert d.triggered and "tokens/s -20%" in d.reason and d.predicted_drop == 0.2


def test_rebuilding_by_replay_gives_the_same_state() -> None:
    policy = DriftPolicy(consecutive=2, cooldown_s=500.0)
    history = [(1.2, False), (1.3, False), (0.2, True), (2.0, False), (0.7, False), (1.5, False)]

    def replay() -> tuple[DriftDetector, list[dict]]:
        det = DriftDetector(policy)
        out = []
        for i, (score, sparse) in enumerate(history):
            out.append(det.observe(_measure(score), 300.0 * (i + 1), sparse=sparse).to_dict())
            if i == 1:
                det.rebase(600.0)
        return det, out

    (a, da), (b, db) = replay(), replay()
    assert a.state == b.state and da == db
    assert a.state.windows == len(history)


# ---------------------------------------------------------------------------- real traces
@pytest.fixture(scope="module")
def azure_conv() -> list[Request]:
    return list(read_trace(AZURE_CONV).requests)


def _replay(reqs: list[Request], proven: TrafficShape) -> list[int]:
    det = DriftDetector(POLICY)
    fired = []
    for w in fold(reqs, WindowSpec(), origin_s=0.0):
        if det.observe(
            measure_drift(proven, w.shape(), POLICY), w.end_s, sparse=w.sparse
        ).triggered:
            fired.append(w.index)
    return fired


def test_stationary_azure_conv_never_triggers(azure_conv: list[Request]) -> None:
    assert _replay(azure_conv, reference_shape(azure_conv)) == []


def test_azure_conv_isl_x1_8_from_the_middle_triggers_within_three_windows(
    azure_conv: list[Request],
) -> None:
    mid = azure_conv[-1].arrival_s / 2
    before = [r for r in azure_conv if r.arrival_s < mid]
    grown = before + [replace(r, isl=round(r.isl * 1.8)) for r in azure_conv if r.arrival_s >= mid]
    fired = _replay(grown, reference_shape(before))
    first_whole = math.ceil(mid / WindowSpec().step_s)  # first window wholly after the change
    assert len(fired) == 1
    assert first_whole <= fired[0] <= first_whole + 3
