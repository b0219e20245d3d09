"""Where the tiers show: the live view and summary of ``kiln compile`` / ``kiln compilations
show``, the Watch stream's event types, and the best-candidates projection's fold."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf.struct_pb2 import Struct
from rich.console import Console

from kiln.agent_runner.snapshot import WATCHED_TYPES
from kiln.cli.compile_view import CompileView, summary_table
from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.best_candidates import BestCandidatesProjection
from kiln.ledger.tables import proj_best_candidates
from kiln.v1 import common_pb2, compiler_pb2


def _event(kind: str, **detail: object) -> compiler_pb2.CompilationEvent:
    s = Struct()
    s.update(detail)
    return compiler_pb2.CompilationEvent(type=kind, detail=s)


def _text(renderable: Any) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_watch_sends_the_tier_agreement() -> None:
    assert "TierAgreement" in WATCHED_TYPES


def test_the_live_view_shows_the_tier_of_a_best_and_the_tier_agreement() -> None:
    view = CompileView("c", budget_s=60)
    sdpa = {"ops": {"attention": "sdpa"}, "transforms": [], "code_modules": [], "lossy": False}
    view.update(
        _event(
            "ExperimentRequested", agent="confirm", tier="full", candidate=sdpa, candidate_id="x"
        )
    )
    assert view.recent[-1] == "confirm → attention=sdpa (full tier)"
    view.update(
        _event("ExperimentCompleted", status="ok", tokens_per_s=40.0, tier="full", candidate_id="x")
    )
    assert view.agents["confirm"] == "ok 40.0 tok/s ← attention=sdpa (full tier)"
    view.update(_event("BestCandidateImproved", tokens_per_s=50.0, speedup=1.25, tier="full"))
    assert view.recent[-1] == "new best 50.0 tok/s (1.25x, full tier)"
    view.update(_event("TierAgreement", n=4, rho=0.8, points=[]))
    assert view.recent[-1] == "fast vs full tier: Spearman rho 0.80 over 4 candidates"
    view.update(_event("TierAgreement", n=1, rho=None, points=[]))
    assert view.recent[-1].endswith("too few to rank")


def test_the_summary_shows_tiers_and_the_agreement_apart_from_the_reason() -> None:
    snap = compiler_pb2.Compilation(
        compilation_id="c",
        status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
        reason="the experiment budget is spent (10 of 10 experiments); "
        "fast vs full tier: Spearman rho 0.80 over 5 candidates",
        baseline=common_pb2.Measurement(tokens_per_s=100.0, tier=common_pb2.TIER_FAST),
        best=common_pb2.BestCandidate(
            measurement=common_pb2.Measurement(tokens_per_s=30.0, tier=common_pb2.TIER_FULL),
            speedup=1.3,
        ),
    )
    text = _text(summary_table(snap))
    assert "succeeded (the experiment budget is spent (10 of 10 experiments))" in text
    assert "fast vs full" in text and "Spearman rho 0.80 over 5 candidates" in text
    # Beside a full-tier best the fast-tier baseline is labelled apart, never "the" baseline.
    assert "fast-tier baseline │ 100.0 tok/s (fast tier: a few layers, not comparable" in text
    assert "│ baseline " not in text and "full tier)" in text
    assert "1.30x over the reference measured next to it on the full tier" in text
    assert "measured at" not in text  # not recorded: no claim
    snap.best.reference.tokens_per_s = 23.1
    snap.best.measurement.batch_size, snap.best.measurement.context_len = 8, 512
    snap.workload.traffic.batch_size, snap.workload.traffic.context_len = 30, 1085
    text = _text(summary_table(snap))
    assert "baseline           │ 23.1 tok/s (full tier, the reference measured next to" in text
    assert "on the full tier (23.1 tok/s)" in text
    assert (
        "batch 8, context 512 tokens (the engine's limits lowered the traffic's batch 30 and "
        "context 1,085)" in text
    )
    snap.workload.traffic.batch_size, snap.workload.traffic.context_len = 8, 512
    text = _text(summary_table(snap))
    assert "batch 8, context 512 tokens" in text and "lowered" not in text
    snap.ClearField("best")
    snap.reason = "enough"
    snap.experiments_done = 10
    text = _text(summary_table(snap))
    assert "none confirmed on the full tier" in text and "100.0 tok/s, fast tier" in text
    assert "fast vs full" not in text and "succeeded (enough)" in text
    # Failed before measuring anything (no plan, say): no claim about candidates.
    snap.experiments_done = 0
    snap.status = compiler_pb2.COMPILATION_STATUS_FAILED
    text = _text(summary_table(snap))
    assert "none: nothing was measured" in text and "beat the reference" not in text


def _best(position: int, tps: float, tier: str) -> StoredEvent:
    return StoredEvent(
        position=position,
        stream_id=f"compilation-c{position}",
        stream_version=3,
        event_id=f"id-{position}",
        type="BestCandidateImproved",
        schema_version=1,
        data={
            "workload_key": "wk",
            "experiment_id": f"e{position}",
            "candidate_id": f"cand{position}",
            "tokens_per_s": tps,
            "median_ms": 1.0,
            "speedup": 1.1,
            "tier": tier,
        },
        metadata={"team": "t"},
        recorded_at=datetime.now(UTC),
    )


def test_a_full_tier_best_replaces_a_fast_tier_one_whatever_the_tokens_per_s() -> None:
    proj = BestCandidatesProjection(proj_best_candidates)
    rows: dict[str, dict[str, Any]] = {}
    for position, tps, tier, winner in [
        (1, 500.0, "fast", "cand1"),
        (2, 600.0, "fast", "cand2"),  # same tier: more tokens/s
        (3, 40.0, "full", "cand3"),  # a confirmed best beats any fast-tier one
        (4, 900.0, "fast", "cand3"),  # and is never replaced by one
        (5, 39.0, "full", "cand3"),
        (6, 45.0, "full", "cand6"),
    ]:
        proj.apply(rows, _best(position, tps, tier))
        assert rows["wk"]["candidate_id"] == winner, position
    assert rows["wk"]["tier"] == "full" and rows["wk"]["tokens_per_s"] == 45.0
