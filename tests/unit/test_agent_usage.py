"""Per-agent usage and the best-so-far curve, projected from events; the progress recorded
with BestCandidateImproved; the Snapshot's agent_usage and progress; old events still parse."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import judgement
from kiln.agent_runner.snapshot import Snapshot
from kiln.agent_runner.usage import device_ms_of, usage_from
from kiln.cli.compile_view import summary_table, time_to_95
from kiln.cli.curve import curve_rows, to_csv
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.domain.curve import CurvePoint, curve_point, time_to_fraction
from kiln.events.registry import parse_payload
from kiln.events.types import BestCandidateImproved, ExperimentCompleted, Tier
from kiln.v1 import compiler_pb2, ledger_pb2

from .agent_records import add, new_state

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _completed(status: str = "ok", tps: float = 100.0, **extra: object) -> dict[str, object]:
    return {"status": status, "correct": status == "ok", "tokens_per_s": tps, **extra}


def test_device_time_is_device_ms_else_the_sum_of_the_phases() -> None:
    assert device_ms_of({"device_ms": 12.5, "phases_ms": {"load": 100.0}}) == 12.5
    assert device_ms_of({"phases_ms": {"load": 1.5, "measure": 3.0}}) == 4.5
    assert device_ms_of({}) == 0.0


def test_usage_per_agent_from_events_in_any_order() -> None:
    book = usage_from(
        [
            ("ExperimentRequested", "e1", {"agent": "random"}),
            ("ExperimentCompleted", "e2", _completed(tps=300.0, device_ms=2000.0)),  # early
            ("ExperimentRequested", "e2", {"agent": "random"}),
            ("ExperimentCompleted", "e1", _completed(tps=200.0, device_ms=1000.0)),
            ("ExperimentCompleted", "e1", _completed(tps=999.0, device_ms=1000.0)),  # twice
            ("ExperimentRequested", "e3", {"agent": "coordinate"}),
            ("ExperimentCompleted", "e3", _completed("crashed", phases_ms={"load": 500.0})),
            ("ExperimentRequested", "e4", {"agent": "confirm"}),
            ("ExperimentCompleted", "e4", _completed(tps=150.0, device_ms=4000.0)),
            ("ExperimentRequested", "e5", {"agent": "coordinate"}),
            ("ExperimentCompleted", "e5", _completed("cancelled")),
            ("CompilationEnded", "", {}),
        ]
    )
    rows = {u.agent: u for u in book.rows()}
    assert list(rows) == ["confirm", "coordinate", "random"]
    r = rows["random"]
    assert (r.experiments, r.ok, r.failed, r.device_s, r.best_tokens_per_s) == (
        2,
        2,
        0,
        3.0,
        300.0,
    )
    c = rows["coordinate"]
    assert (c.experiments, c.ok, c.failed, c.device_ms, c.best_tokens_per_s) == (1, 0, 1, 500, 0)
    assert rows["confirm"].device_s == 4.0
    assert book.experiments == 4 and book.device_ms == 7500.0


def test_the_curve_and_time_to_95_percent() -> None:
    def point(t: float, tps: float) -> CurvePoint:
        return CurvePoint(t, 0, 0.0, tps, tps / 100, "c", "e")

    assert time_to_fraction([]) is None
    points = [point(10, 120.0), point(40, 190.0), point(90, 200.0)]
    assert time_to_fraction(points, 0.95) == 40  # 190 >= 0.95 x 200
    assert time_to_fraction(points, 1.0) == 90
    assert time_to_fraction(points, 0.5) == 10
    with pytest.raises(ValueError, match="fraction"):
        time_to_fraction(points, 0)


def test_an_old_best_event_parses_and_gets_its_elapsed_time_from_the_ledger() -> None:
    old = {
        "workload_key": "wk",
        "experiment_id": "e9",
        "candidate_id": "c9",
        "tokens_per_s": 50.0,
        "median_ms": 20.0,
        "speedup": 1.3,
        "tier": "full",
    }
    parsed = parse_payload(BestCandidateImproved, old)
    assert (parsed.elapsed_s, parsed.experiments, parsed.device_s) == (0.0, 0, 0.0)
    p = curve_point(old, T0 + timedelta(seconds=75), T0)
    assert (p.elapsed_s, p.experiments, p.tokens_per_s, p.speedup) == (75.0, 0, 50.0, 1.3)
    done = parse_payload(
        ExperimentCompleted,
        {
            "compilation_id": "c",
            "candidate_id": "x",
            "status": "ok",
            "correct": True,
            "tier": "fast",
        },
    )
    assert done.device_ms == 0.0 and done.environment == {}


def test_a_new_best_records_elapsed_time_experiments_and_device_time() -> None:
    state = new_state(baseline=100.0, submitted_at=T0)
    cand = Candidate.make({"attention": "sdpa"})

    def record(
        k: int, cand: Candidate, agent: str, tier: Tier, tps: float, ms: float
    ) -> tuple[Requested, Completed]:
        at = T0 + timedelta(seconds=10 * k)
        return add(state, cand, agent, tps, tier=tier, device_ms=ms, at=at)

    record(1, REFERENCE_CANDIDATE, "baseline", "fast", 100.0, 1000.0)
    record(2, cand, "random", "fast", 150.0, 2000.0)
    record(3, REFERENCE_CANDIDATE, "confirm", "full", 50.0, 3000.0)
    req, done = record(4, cand, "confirm", "full", 70.0, 4000.0)
    # completed after the confirmation (a later ledger position): not counted in its progress
    record(5, Candidate.make({"mlp": "fused_gate_up"}), "random", "fast", 90, 9000.0)
    event = judgement(state, req, done)
    assert event is not None and isinstance(event.data, dict)
    assert event.data["elapsed_s"] == 40.0
    assert event.data["experiments"] == 4
    assert event.data["device_s"] == pytest.approx(10.0)
    assert event.data["speedup"] == pytest.approx(70 / 50)
    assert parse_payload(BestCandidateImproved, event.data).experiments == 4


def _recorded(
    stream: str, kind: str, data: dict[str, object], pos: int, at: datetime
) -> ledger_pb2.RecordedEvent:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ledger_pb2.RecordedEvent(
        stream_id=stream,
        type=kind,
        data=json.dumps(data).encode(),
        position=pos,
        stream_version=pos,
        recorded_at=ts,
    )


def test_the_snapshot_carries_agent_usage_and_progress_for_the_summary() -> None:
    snap = Snapshot("c1")
    workload = {"workload_key": "wk", "model": {"name": "m"}, "hardware": {"name": "cpu"}}
    submitted = {
        "workload_key": "wk",
        "model_name": "m",
        "hardware": "cpu",
        "workload": workload,
        "budget": {"wall_seconds": 60},
    }
    cand = Candidate.make({"attention": "sdpa"})
    requested = {
        "compilation_id": "c1",
        "candidate_id": cand.id,
        "candidate": cand.canonical(),
        "tier": "full",
        "agent": "confirm",
    }
    completed = {
        "compilation_id": "c1",
        "candidate_id": cand.id,
        "status": "ok",
        "correct": True,
        "tokens_per_s": 80.0,
        "tier": "full",
        "device_ms": 2500.0,
    }
    best = {
        "workload_key": "wk",
        "experiment_id": "x1",
        "candidate_id": cand.id,
        "tokens_per_s": 80.0,
        "median_ms": 12.5,
        "speedup": 1.6,
        "tier": "full",
        "experiments": 1,
        "device_s": 2.5,
    }
    for event in [
        _recorded("compilation-c1", "CompilationSubmitted", submitted, 1, T0),
        _recorded("experiment-x1", "ExperimentRequested", requested, 2, T0),
        _recorded("experiment-x1", "ExperimentCompleted", completed, 3, T0),
        _recorded("compilation-c1", "BestCandidateImproved", best, 4, T0 + timedelta(seconds=30)),
    ]:
        assert snap.belongs(event)
        snap.apply(event)
    m = snap.message
    assert [(u.agent, u.experiments, u.ok, u.device_seconds) for u in m.agent_usage] == [
        ("confirm", 1, 1, 2.5)
    ]
    assert [(p.elapsed_s, p.experiments, p.device_s, p.speedup) for p in m.progress] == [
        (30.0, 1, 2.5, 1.6)
    ]
    assert time_to_95(m) == 30.0
    rows = curve_rows(m)
    assert rows[0]["tokens_per_s"] == 80.0
    assert to_csv(rows).splitlines()[0].startswith("elapsed_s,experiments,device_s")
    table = summary_table(m)
    cells = [str(c) for col in table.columns for c in col._cells]
    assert "time to 95% of final best" in cells and "30 s" in cells
    assert "agent confirm" in cells
    assert any("device 2.5 s" in c for c in cells)
    assert any(c.endswith("best 80.0 tok/s (full tier)") for c in cells)  # confirm's tier
    assert isinstance(m, compiler_pb2.Compilation)
