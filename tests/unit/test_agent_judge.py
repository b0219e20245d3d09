"""Judging completed experiments (baseline, fast leader, confirmation on the full tier,
best-so-far), the tier agreement, and finding orphan claims. Pure: no services."""

from __future__ import annotations

import pytest

from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import (
    agreement_text,
    average_ranks,
    confirmation_due,
    distinguishable,
    fast_leader,
    full_reference,
    judgement,
    needs_reference,
    spearman,
    speedup,
    tier_agreement,
    tier_points,
)
from kiln.agent_runner.resume import orphan_claims
from kiln.agent_runner.state import Best, CompilationState, ExperimentRecord
from kiln.board import BoardPost
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.events.registry import validate_event
from kiln.events.types import ExperimentCompleted, Tier

from .agent_records import add as _add
from .agent_records import done as _done
from .agent_records import new_state as _state

REF = REFERENCE_CANDIDATE
A = Candidate.make({"attention": "sdpa"})
B = Candidate.make({"mlp": "fused_gate_up"})
C = Candidate.make({"qkv_proj": "fused"})


def _full(
    state: CompilationState, cand: Candidate, tps: float, status: str = "ok", spread: float = 0.02
) -> tuple[Requested, Completed]:
    return _add(state, cand, "confirm", tps, status, "full", spread)


def _pending(state: CompilationState, cand: Candidate, tier: Tier = "full") -> Requested:
    req, _ = _done(cand, "confirm", 0.0, tier=tier)
    state.experiments[req.experiment_id] = ExperimentRecord(req)
    return req


def _apply(state: CompilationState, event: object) -> None:
    assert event is not None
    state.apply_data(event.type, event.data, state.version + 1)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- the baseline
def test_the_reference_by_baseline_on_the_fast_tier_sets_the_baseline_once() -> None:
    event = judgement(_state(), *_done(REF, "baseline", 100.0))
    assert event is not None and event.type == "BaselineMeasured"
    assert isinstance(event.data, dict) and event.data["tokens_per_s"] == 100.0
    assert judgement(_state(baseline=90.0), *_done(REF, "baseline", 100)) is None
    assert judgement(_state(), *_done(REF, "baseline", 0.0)) is None
    assert judgement(_state(), *_done(REF, "baseline", 9, "crashed")) is None
    assert judgement(_state(), *_done(REF, "confirm", 100.0, tier="full")) is None


# ---------------------------------------------------------------------- the fast leader
def test_a_fast_result_is_never_a_best_by_itself() -> None:
    state = _state(baseline=100.0)
    assert judgement(state, *_add(state, A, "random", 500.0)) is None
    assert confirmation_due(state) == A


def test_the_fast_leader_is_the_fastest_correct_candidate_above_the_baseline() -> None:
    state = _state()
    _add(state, A, "random", 150.0)
    assert fast_leader(state) is None  # no baseline yet
    state = _state(baseline=100.0)
    _add(state, A, "random", 90.0)
    _add(state, REF, "baseline", 500.0)  # the reference is never a leader
    _add(state, B, "random", 900.0, "incorrect")
    assert fast_leader(state) is None
    a = _add(state, A, "coordinate", 130.0)
    _add(state, C, "random", 130.0)  # a tie: the earlier result leads
    assert fast_leader(state) == a
    d = _add(state, Candidate.make({"rope": "cos_sin_cache"}), "random", 131.0)
    assert fast_leader(state) == d


def test_a_leader_is_due_until_it_has_a_full_tier_experiment() -> None:
    state = _state(baseline=100.0)
    assert confirmation_due(state) is None
    _add(state, A, "random", 150.0)
    assert confirmation_due(state) == A  # e.g. after a restart before its request
    _pending(state, REF)
    assert confirmation_due(state) == A
    _pending(state, A)
    assert confirmation_due(state) is None  # in flight
    _add(state, B, "coordinate", 140.0)
    assert confirmation_due(state) is None  # B does not lead
    _add(state, C, "coordinate", 160.0)
    assert confirmation_due(state) == C


def test_a_leader_overtaken_before_its_confirmation_is_not_confirmed() -> None:
    state = _state(baseline=100.0)
    _add(state, A, "random", 150.0)
    _add(state, B, "random", 170.0)
    assert confirmation_due(state) == B
    _full(state, REF, 50.0)
    _full(state, B, 80.0)
    assert confirmation_due(state) is None


def test_a_confirmation_starts_with_the_reference_unless_the_last_full_request_is_one() -> None:
    state = _state(baseline=100.0)
    assert needs_reference(state)
    _pending(state, REF)
    assert not needs_reference(state)  # a pair cut by a restart: its reference is on its way
    state = _state(baseline=100.0)
    _full(state, REF, 50.0, "crashed")
    assert not needs_reference(state)  # go on: the candidate uses an earlier reference
    _full(state, A, 70.0)
    assert needs_reference(state)


# ---------------------------------------------------------------------- confirmation
def test_a_confirmed_candidate_is_the_new_best_with_its_speedup_over_the_nearest_reference() -> (
    None
):
    state = _state(baseline=100.0)
    _add(state, A, "random", 150.0)
    _full(state, REF, 40.0)
    _full(state, REF, 50.0)
    req, completed = _full(state, A, 60.0)
    event = judgement(state, req, completed)
    assert event is not None and event.type == "BestCandidateImproved"
    assert isinstance(event.data, dict)
    assert event.data["tier"] == "full" and event.data["candidate_id"] == A.id
    assert event.data["tokens_per_s"] == 60.0 and event.data["workload_key"] == "wk-1"
    assert event.data["speedup"] == pytest.approx(60.0 / 50.0)  # not over 40, not the median
    assert speedup(state, completed) == pytest.approx(1.2)
    _apply(state, event)
    assert state.best is not None and state.best.speedup == pytest.approx(1.2)
    assert judgement(state, req, completed) is None  # judged again: nothing new


def test_the_nearest_reference_skips_failed_and_later_ones() -> None:
    state = _state(baseline=100.0)
    assert full_reference(state, 10**9) is None
    first = _full(state, REF, 50.0)[1]
    _full(state, REF, 0.0, "crashed")
    _full(state, A, 70.0)  # a candidate is never a reference
    _, completed = _full(state, B, 60.0)
    _full(state, REF, 30.0)  # after the candidate
    assert full_reference(state, completed.position) == first
    assert speedup(state, completed) == pytest.approx(60.0 / 50.0)


def test_interleaved_references_cancel_the_drift_of_the_host() -> None:
    """The host slows down between two confirmations: B's raw tokens/s are below A's, but
    against the reference measured next to each, B is faster and becomes the best."""
    state = _state(baseline=100.0)
    _add(state, A, "random", 150.0)
    _full(state, REF, 200.0)
    _apply(state, judgement(state, *_full(state, A, 300.0)))  # 1.5x
    _add(state, B, "random", 160.0)
    _full(state, REF, 150.0)
    req, completed = _full(state, B, 240.0)  # 1.6x, fewer tokens/s than A's 300
    event = judgement(state, req, completed)
    assert event is not None and isinstance(event.data, dict)
    assert event.data["speedup"] == pytest.approx(1.6)
    _add(state, C, "random", 170.0)
    _full(state, REF, 150.0)
    _apply(state, event)
    _add(state, C, "random", 170.0)
    _full(state, REF, 150.0)
    assert judgement(state, *_full(state, C, 230.0)) is None  # 1.53x < 1.6x


def _gpu_state(baseline: float) -> CompilationState:
    state = _state(baseline=baseline)
    state.workload.hardware.name = "h200"
    return state


def test_on_a_gpu_the_best_is_ranked_by_its_own_tokens_per_s() -> None:
    """The H200 case (benchmarks/RESULTS.md, issue 5): the eager reference next to B is slower
    than the one next to A, so B's speedup is higher although B decodes fewer tokens/s."""
    state = _gpu_state(baseline=100.0)
    _add(state, A, "random", 150.0)
    _full(state, REF, 65.0)
    _apply(state, judgement(state, *_full(state, A, 1037.0)))  # 16x
    assert state.best is not None and state.best.candidate_id == A.id
    _add(state, B, "random", 160.0)
    _full(state, REF, 41.8)
    assert judgement(state, *_full(state, B, 956.8)) is None  # 22.9x, but slower than A
    _add(state, C, "random", 170.0)
    _full(state, REF, 80.0)
    event = judgement(state, *_full(state, C, 1100.0))  # 13.75x, and faster than A
    assert event is not None and isinstance(event.data, dict)
    assert event.data["tokens_per_s"] == 1100.0
    assert event.data["speedup"] == pytest.approx(13.75)


def test_on_a_cpu_the_best_is_ranked_by_speedup() -> None:
    state = _state(baseline=100.0)
    state.workload.hardware.name = "cpu"
    _add(state, A, "random", 150.0)
    _full(state, REF, 200.0)
    _apply(state, judgement(state, *_full(state, A, 300.0)))  # 1.5x
    _add(state, B, "random", 160.0)
    _full(state, REF, 400.0)
    assert judgement(state, *_full(state, B, 500.0)) is None  # more tokens/s, only 1.25x


def test_no_best_from_a_confirmation_that_is_slower_incorrect_or_has_no_reference() -> None:
    state = _state(baseline=100.0)
    _full(state, REF, 50.0)
    assert judgement(state, *_full(state, A, 50.0)) is None  # not faster than the reference
    assert judgement(state, *_full(state, B, 500.0, "incorrect")) is None
    assert judgement(state, *_full(state, REF, 80.0)) is None  # the reference itself
    state.best = Best("e1", "x", 90.0, 5.0, 1.5)
    assert judgement(state, *_full(state, C, 70.0)) is None  # 1.4x < the best's 1.5x
    empty = _state(baseline=100.0)
    assert judgement(empty, *_full(empty, A, 500.0)) is None  # no reference measured


def test_speedup_on_each_tier() -> None:
    state = _state(baseline=200.0)
    assert speedup(state, _done(A, "x", 300.0)[1]) == 1.5
    assert speedup(_state(), _done(A, "x", 300.0)[1]) is None
    assert speedup(state, _done(A, "x", 300.0, "incorrect")[1]) is None
    assert speedup(state, _done(A, "confirm", 30.0, tier="full")[1]) is None  # no reference


# ---------------------------------------------------------------------- rank correlation
def test_average_ranks_share_ties() -> None:
    assert average_ranks([]) == []
    assert average_ranks([30.0, 10.0, 20.0]) == [3.0, 1.0, 2.0]
    assert average_ranks([10.0, 20.0, 20.0, 30.0]) == [1.0, 2.5, 2.5, 4.0]
    assert average_ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


def test_spearman() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)  # ranks, not values
    # Without ties it is 1 - 6·Σd²/(n(n²-1)): d = (-1, 1, -1, 1, 0) -> 1 - 24/120.
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # With ties, Pearson's r of average ranks (scipy.stats.spearmanr gives the same).
    assert spearman([10, 20, 20, 30], [1, 2, 3, 4]) == pytest.approx(4.5 / 22.5**0.5)
    assert spearman([1.0], [2.0]) is None
    assert spearman([], []) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # one side ranks them all equal
    with pytest.raises(ValueError, match="3 values against 2"):
        spearman([1, 2, 3], [1, 2])


def test_tier_points_pair_each_candidate_measured_correct_on_both_tiers() -> None:
    state = _state(baseline=100.0)
    _add(state, REF, "baseline", 100.0)
    _add(state, A, "random", 150.0)
    _add(state, B, "random", 140.0)
    _add(state, C, "random", 130.0)
    _full(state, REF, 40.0)
    _full(state, A, 50.0)
    _full(state, REF, 30.0)
    _full(state, B, 60.0)
    _full(state, REF, 45.0)
    _full(state, C, 99.0, "incorrect")
    points = tier_points(state)
    assert [(p.candidate_id, p.fast_tokens_per_s, p.full_tokens_per_s) for p in points] == [
        (REF.id, 100.0, 40.0),  # the median of 40, 30, 45
        (A.id, 150.0, 50.0),
        (B.id, 140.0, 60.0),
    ]
    event = tier_agreement(state)
    assert event.type == "TierAgreement" and isinstance(event.data, dict)
    assert event.data["n"] == 3
    assert event.data["rho"] == pytest.approx(0.5)  # ranks (1, 3, 2) vs (1, 2, 3)
    assert event.event_id == tier_agreement(state).event_id  # one per compilation
    version, stored = validate_event("compilation-c1", event.type, 0, event.data)
    assert version == 1 and stored == event.data
    _apply(state, event)
    assert state.tier_agreement == (3, pytest.approx(0.5))


def test_tier_agreement_with_nothing_confirmed() -> None:
    state = _state(baseline=100.0)
    _add(state, REF, "baseline", 100.0)
    _add(state, A, "random", 150.0)
    event = tier_agreement(state)
    assert isinstance(event.data, dict)
    assert event.data == {"n": 0, "rho": None, "points": []}
    _apply(state, event)
    assert state.tier_agreement == (0, None)


def test_agreement_text() -> None:
    assert agreement_text(5, 0.8) == "fast vs full tier: Spearman rho 0.80 over 5 candidates"
    assert "no candidate" in agreement_text(0, None)
    assert "too few" in agreement_text(1, None)
    assert "ties them all" in agreement_text(3, None)


# ---------------------------------------------------------------------- orphan claims
def test_orphan_claims_are_claims_never_requested_with_a_recipe() -> None:
    other = Candidate.make({"mlp": "fused_gate_up"})

    def claim(cand_id: str, body: dict) -> BoardPost:
        return BoardPost(
            kind="claim", compilation_id="c1", candidate_id=cand_id, agent="a", body=body
        )

    posts = [
        claim(A.id, {"candidate": A.canonical()}),
        claim(other.id, {"candidate": other.canonical()}),
        claim("deadbeef", {"candidate": A.canonical()}),  # recipe does not match the id
        claim("cafe", {}),  # no recipe
    ]
    assert orphan_claims(posts, requested={other.id}) == [(A, "a")]


def test_a_confirmation_within_the_noise_is_not_a_best() -> None:
    state = _state(baseline=100.0)
    _add(state, A, "random", 150.0)
    _full(state, REF, 50.0, spread=0.10)
    # 9 % faster in median, but its p10-p90 band overlaps the reference's: noise, not a win
    req, completed = _full(state, A, 54.5, spread=0.10)
    assert judgement(state, req, completed) is None
    # clearly apart: a win
    _full(state, REF, 50.0, spread=0.10)
    req, completed = _full(state, A, 80.0, spread=0.10)
    event = judgement(state, req, completed)
    assert event is not None and event.data["speedup"] == pytest.approx(1.6)  # type: ignore[index]


def test_front_loaded_work_cannot_hide_below_the_band() -> None:
    """A candidate whose p90 step clears the reference's p10 but whose mean says the work was
    done in a few steps: its band's top is its decision step, max(median, mean / 1.25)."""

    def result(median: float, p10: float, p90: float, mean: float = 0.0) -> ExperimentCompleted:
        return ExperimentCompleted(
            compilation_id="c1",
            candidate_id="x",
            status="ok",
            correct=True,
            median_ms=median,
            p10_ms=p10,
            p90_ms=p90,
            mean_ms=mean,
            tier="full",
        )

    reference = result(20.0, 19.0, 21.0, 20.0)
    assert distinguishable(result(10.0, 9.8, 10.2, 10.5), reference)
    assert not distinguishable(result(10.0, 9.8, 10.2, 40.0), reference)  # 40 / 1.25 = 32 > 19
    assert distinguishable(result(10.0, 9.8, 10.2), reference)  # an old event: no mean
    # without percentiles the decision steps are compared
    assert not distinguishable(result(10.0, 0.0, 0.0, 40.0), result(20.0, 0.0, 0.0, 20.0))
