"""What a compilation's search came to (kiln.agent_runner.outcome), from its recorded events,
and old streams without ``CompilationEnded.outcome`` still folding."""

from __future__ import annotations

from typing import Any

from kiln.agent_runner import records
from kiln.agent_runner.outcome import outcome_of
from kiln.agent_runner.snapshot import Snapshot
from kiln.agent_runner.state import CompilationState
from kiln.domain.candidate import Candidate
from kiln.ledger.model import NewEvent
from kiln.v1 import compiler_pb2

from .test_agent_snapshot import CID, _Story

STREAM = records.compilation_stream(CID)
REF = Candidate()
SDPA = Candidate.make({"attention": "sdpa"})


def _done(cand: Candidate, tier: str, tps: float, status: str = "ok", **kw: Any) -> NewEvent:
    data: dict[str, Any] = {
        "compilation_id": CID,
        "candidate_id": cand.id,
        "status": status,
        "correct": status == "ok",
        "median_ms": 1000.0 * 8 / tps if tps else 0.0,
        "p10_ms": 900.0 * 8 / tps if tps else 0.0,
        "p90_ms": 1100.0 * 8 / tps if tps else 0.0,
        "tokens_per_s": tps,
        "tier": tier,
        "engine_id": "e0",
        **kw,
    }
    return NewEvent("ExperimentCompleted", data)


def _story(*experiments: tuple[Candidate, str, str, float, str]) -> _Story:
    """Submitted, planned, the baseline (100 tok/s), then (candidate, agent, tier, tok/s,
    status) experiments."""
    s = _Story()
    s.add(
        STREAM,
        records.submitted(
            CID,
            workload_key="wk-1",
            model_name="m",
            hardware="cpu",
            workload={"model": {"name": "m"}, "hardware": {"name": "cpu"}},
            wall_seconds=60.0,
            max_experiments=0,
            agents=["coordinate"],
        ),
    )
    s.add(STREAM, records.planned(CID, {"tp": 1, "feasible": True}))
    s.add("experiment-b", records.experiment_requested(CID, "b", REF, "fast", "baseline"))
    s.add("experiment-b", _done(REF, "fast", 100.0))
    s.add(STREAM, records.baseline_measured(CID, "b", REF.id, 100.0, 80.0))
    for i, (cand, agent, tier, tps, status) in enumerate(experiments):
        eid = f"x{i}"
        s.add(f"experiment-{eid}", records.experiment_requested(CID, eid, cand, tier, agent))  # type: ignore[arg-type]
        s.add(f"experiment-{eid}", _done(cand, tier, tps, status))
    return s


def _state(story: _Story) -> CompilationState:
    own = [e for e in story.events if e.stream_id == STREAM]
    state = CompilationState.from_events(own)
    for event in story.events:
        if event.stream_id != STREAM:
            state.apply_experiment(event)
    return state


def test_nothing_faster_than_the_baseline_on_the_fast_tier() -> None:
    state = _state(_story((SDPA, "coordinate", "fast", 90.0, "ok")))
    outcome, why = outcome_of(state)
    assert outcome == "none_beat_the_baseline"
    assert (
        why == "none of the 1 candidates measured correct on the fast tier beat the reference there"
    )
    state = _state(_story((SDPA, "coordinate", "fast", 0.0, "incorrect")))
    assert outcome_of(state) == (
        "none_beat_the_baseline",
        "no candidate measured correct on the fast tier",
    )


def test_a_leader_never_measured_on_the_full_tier() -> None:
    state = _state(_story((SDPA, "coordinate", "fast", 130.0, "ok")))
    outcome, why = outcome_of(state)
    assert outcome == "unconfirmed"
    assert why == (
        "the fast tier's leader (attention=sdpa, 1.30x there) was not measured on the full tier "
        "before the end"
    )
    cut = _state(
        _story(
            (SDPA, "coordinate", "fast", 130.0, "ok"), (SDPA, "confirm", "full", 0.0, "cancelled")
        )
    )
    assert outcome_of(cut)[1].endswith("ended before its full-tier confirmation finished")


def test_a_full_tier_reference_that_failed_is_named() -> None:
    state = _state(
        _story((SDPA, "coordinate", "fast", 130.0, "ok"), (REF, "confirm", "full", 0.0, "crashed"))
    )
    outcome, why = outcome_of(state)
    assert outcome == "unconfirmed"
    assert why.startswith("the reference did not measure correct on the full tier (crashed")


def test_every_confirmation_losing_is_lost_on_the_full_tier() -> None:
    state = _state(
        _story(
            (SDPA, "coordinate", "fast", 130.0, "ok"),
            (REF, "confirm", "full", 25.0, "ok"),
            (SDPA, "confirm", "full", 24.0, "ok"),
        )
    )
    outcome, why = outcome_of(state)
    assert outcome == "lost_on_full_tier"
    assert why == (
        "1 candidate(s) measured on the full tier and none beat the reference measured next to "
        "it beyond timing noise (best 0.96x)"
    )
    assert "; " not in why  # the reason's next clause starts after the first "; "


def test_a_best_is_confirmed() -> None:
    story = _story((SDPA, "coordinate", "fast", 130.0, "ok"))
    story.add(
        STREAM,
        records.best_improved(
            CID,
            workload_key="wk-1",
            experiment_id="x0",
            candidate_id=SDPA.id,
            tokens_per_s=30.0,
            median_ms=8.0,
            speedup=1.2,
            tier="full",
        ),
    )
    assert outcome_of(_state(story)) == ("confirmed", "")


def test_an_old_stream_without_the_outcome_still_folds() -> None:
    story = _story((SDPA, "coordinate", "fast", 90.0, "ok"))
    old = NewEvent("CompilationEnded", {"status": "succeeded", "reason": "budget spent"})
    story.add(STREAM, old)
    snap = Snapshot(CID)
    for event in story.events:
        snap.apply(event)
    m = snap.message
    assert m.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED and m.outcome == ""
    assert m.reason == "budget spent"
    state = _state(story)
    assert state.ended and state.compilation.outcome == ""
    new = _story()
    new.add(STREAM, records.ended(CID, "succeeded", "x", "none_beat_the_baseline"))
    assert _state(new).compilation.outcome == "none_beat_the_baseline"
