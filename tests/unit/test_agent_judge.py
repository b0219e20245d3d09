"""Judging completed experiments (baseline, best so far) and finding orphan claims."""

from __future__ import annotations

from datetime import UTC, datetime

from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import judgement, speedup
from kiln.agent_runner.resume import orphan_claims
from kiln.agent_runner.state import Baseline, Best, CompilationState
from kiln.board import BoardPost
from kiln.events.types import ExperimentCompleted
from kiln.v1 import common_pb2
from kiln.workloads.candidate import REFERENCE_CANDIDATE, Candidate

FAST = Candidate.make({"attention": "sdpa"})


def _state(baseline: float | None = None, best: float | None = None) -> CompilationState:
    state = CompilationState(
        compilation_id="c1",
        team="search",
        workload=common_pb2.Workload(workload_key="wk-1"),
        wall_seconds=60,
        max_experiments=0,
        agents=[],
        submitted_at=datetime.now(UTC),
        submitted_position=1,
    )
    if baseline is not None:
        state.baseline = Baseline("e0", REFERENCE_CANDIDATE.id, baseline, 10.0)
    if best is not None:
        state.best = Best("e1", "x", best, 5.0, best / (baseline or 1))
    return state


def _done(
    cand: Candidate, agent: str, tps: float, status: str = "ok"
) -> tuple[Requested, Completed]:
    req = Requested("e9", "c1", "search", cand, agent, "fast", 5)
    result = ExperimentCompleted(
        compilation_id="c1",
        candidate_id=cand.id,
        status=status,  # type: ignore[arg-type]
        correct=status == "ok",
        max_abs_error=0.0,
        median_ms=2.0,
        p10_ms=2.0,
        p90_ms=2.0,
        tokens_per_s=tps,
        memory_bytes=0,
        engine_id="e",
        tier="fast",
        error="",
    )
    return req, Completed("e9", result, 6, datetime.now(UTC))


def test_the_reference_by_baseline_sets_the_baseline_once() -> None:
    event = judgement(_state(), *_done(REFERENCE_CANDIDATE, "baseline", 100.0))
    assert event is not None and event.type == "BaselineMeasured"
    assert isinstance(event.data, dict) and event.data["tokens_per_s"] == 100.0
    assert judgement(_state(baseline=90.0), *_done(REFERENCE_CANDIDATE, "baseline", 100)) is None
    assert judgement(_state(), *_done(REFERENCE_CANDIDATE, "baseline", 0.0)) is None
    assert judgement(_state(), *_done(REFERENCE_CANDIDATE, "baseline", 9, "crashed")) is None


def test_a_faster_correct_candidate_is_a_new_best_with_its_speedup() -> None:
    event = judgement(_state(baseline=100.0), *_done(FAST, "random", 150.0))
    assert event is not None and event.type == "BestCandidateImproved"
    assert isinstance(event.data, dict)
    assert event.data["speedup"] == 1.5 and event.data["workload_key"] == "wk-1"
    assert event.data["tier"] == "fast" and event.data["candidate_id"] == FAST.id


def test_no_best_when_slower_incorrect_or_before_the_baseline() -> None:
    assert judgement(_state(baseline=100.0), *_done(FAST, "random", 90.0)) is None
    assert judgement(_state(baseline=100.0, best=160.0), *_done(FAST, "random", 150.0)) is None
    assert judgement(_state(baseline=100.0), *_done(FAST, "random", 500.0, "incorrect")) is None
    assert judgement(_state(), *_done(FAST, "random", 500.0)) is None


def test_speedup() -> None:
    assert speedup(_state(baseline=200.0), _done(FAST, "x", 300.0)[1]) == 1.5
    assert speedup(_state(), _done(FAST, "x", 300.0)[1]) is None


def test_orphan_claims_are_claims_never_requested_with_a_recipe() -> None:
    other = Candidate.make({"mlp": "fused_gate_up"})

    def claim(cand_id: str, body: dict) -> BoardPost:
        return BoardPost(
            kind="claim", compilation_id="c1", candidate_id=cand_id, agent="a", body=body
        )

    posts = [
        claim(FAST.id, {"candidate": FAST.canonical()}),
        claim(other.id, {"candidate": other.canonical()}),
        claim("deadbeef", {"candidate": FAST.canonical()}),  # recipe does not match the id
        claim("cafe", {}),  # no recipe
    ]
    assert orphan_claims(posts, requested={other.id}) == [(FAST, "a")]
