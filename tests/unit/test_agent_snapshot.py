"""Folding a compilation's events into kiln.v1.Compilation, and the runner's stream state."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from kiln.agent_runner import records
from kiln.agent_runner.snapshot import Snapshot, from_row
from kiln.agent_runner.state import CompilationState
from kiln.domain.candidate import Candidate
from kiln.ledger.model import NewEvent
from kiln.v1 import common_pb2, compiler_pb2, ledger_pb2

CID = "c1"


class _Story:
    """Recorded events built from the runner's own event builders."""

    def __init__(self) -> None:
        self.events: list[ledger_pb2.RecordedEvent] = []
        self.versions: dict[str, int] = {}

    def add(self, stream: str, event: NewEvent) -> ledger_pb2.RecordedEvent:
        self.versions[stream] = self.versions.get(stream, 0) + 1
        recorded = ledger_pb2.RecordedEvent(
            position=len(self.events) + 1,
            stream_id=stream,
            stream_version=self.versions[stream],
            event_id=event.event_id,
            type=event.type,
            data=json.dumps(event.data).encode(),
            metadata=ledger_pb2.EventMetadata(team="search"),
        )
        recorded.recorded_at.FromDatetime(datetime(2026, 1, 1, tzinfo=UTC))
        self.events.append(recorded)
        return recorded


def _completed(eid: str, cand: Candidate, tps: float, status: str = "ok") -> NewEvent:
    data: dict[str, Any] = {
        "compilation_id": CID,
        "candidate_id": cand.id,
        "status": status,
        "correct": status == "ok",
        "median_ms": 10.0,
        "tokens_per_s": tps,
        "tier": "fast",
        "engine_id": "e0",
    }
    return NewEvent("ExperimentCompleted", data)


def _story() -> _Story:
    s, stream = _Story(), records.compilation_stream(CID)
    workload = common_pb2.Workload(
        model=common_pb2.ModelSpec(name="m"), hardware=common_pb2.HardwareTarget(name="cpu")
    )
    s.add(
        stream,
        records.submitted(
            CID,
            workload_key="wk-1",
            model_name="m",
            hardware="cpu",
            workload={"model": {"name": "m"}, "hardware": {"name": "cpu"}},
            wall_seconds=60.0,
            max_experiments=5,
            agents=["coordinate", "random"],
        ),
    )
    del workload
    s.add(stream, records.planned(CID, {"tp": 1, "feasible": True, "estimate_tier": "roofline"}))
    ref, fast = Candidate(), Candidate.make({"attention": "sdpa"})
    s.add("experiment-e0", records.experiment_requested(CID, "e0", ref, "fast", "baseline"))
    s.add("experiment-e0", _completed("e0", ref, 100.0))
    s.add(stream, records.baseline_measured(CID, "e0", ref.id, 100.0, 10.0))
    s.add("experiment-e1", records.experiment_requested(CID, "e1", fast, "fast", "random"))
    s.add("experiment-e1", _completed("e1", fast, 150.0))
    s.add(
        stream,
        records.best_improved(
            CID,
            workload_key="wk-1",
            experiment_id="e1",
            candidate_id=fast.id,
            tokens_per_s=150.0,
            median_ms=9.0,
            speedup=1.5,
            tier="fast",
        ),
    )
    s.add(
        "experiment-e2",
        records.experiment_requested(
            CID, "e2", Candidate.make({"mlp": "fused_gate_up"}), "fast", "coordinate"
        ),
    )
    s.add("experiment-e2", records.experiment_unanswered(CID, "e2", "x", "fast", "no engine"))
    s.add(stream, records.cancel_requested(CID, "enough"))
    s.add(stream, records.ended(CID, "cancelled", "enough"))
    return s


def test_snapshot_folds_the_whole_story() -> None:
    snap = Snapshot(CID)
    statuses = []
    for event in _story().events:
        assert snap.belongs(event)
        snap.apply(event)
        statuses.append(snap.message.status)
    m = snap.message
    assert statuses[0] == compiler_pb2.COMPILATION_STATUS_PENDING
    assert statuses[1] == compiler_pb2.COMPILATION_STATUS_RUNNING
    assert m.status == compiler_pb2.COMPILATION_STATUS_CANCELLED and m.reason == "enough"
    assert m.team == "search" and m.workload.workload_key == "wk-1"
    assert m.budget.wall_seconds == 60.0 and m.budget.max_experiments == 5
    assert m.plan.feasible and m.plan.tp == 1
    assert m.experiments_done == 3 and m.failures == 1
    assert m.baseline.tokens_per_s == 100.0 and m.baseline.engine_id == "e0"
    assert m.best.speedup == 1.5 and m.best.experiment_id == "e1"
    assert dict(m.best.candidate.ops) == {"attention": "sdpa"}
    assert m.best.measurement.status == common_pb2.EXPERIMENT_STATUS_OK
    assert snap.ended


def test_snapshot_ignores_other_compilations() -> None:
    other = ledger_pb2.RecordedEvent(
        stream_id="experiment-zz",
        type="ExperimentCompleted",
        data=json.dumps({"compilation_id": "c2"}).encode(),
    )
    assert not Snapshot(CID).belongs(other)


def test_state_folds_the_compilation_stream() -> None:
    events = [e for e in _story().events if e.stream_id == "compilation-c1"]
    state = CompilationState.from_events(events[:4])
    assert state.team == "search" and state.max_experiments == 5 and state.wall_seconds == 60
    assert state.plan == {"tp": 1, "feasible": True, "estimate_tier": "roofline"}
    assert state.baseline and state.baseline.tokens_per_s == 100.0
    assert state.best and state.best.speedup == 1.5 and not state.ended
    for event in events[4:]:
        state.apply(event)
    assert state.cancel_reason == "enough" and state.end_status == "cancelled"
    state.apply(events[2])  # an old version is ignored
    assert state.version == len(events)


def test_deterministic_event_ids() -> None:
    assert (
        records.ended("c", "succeeded", "x").event_id == records.ended("c", "failed", "y").event_id
    )
    assert records.planned("c", {}).event_id != records.planned("d", {}).event_id
    assert (
        records.submitted(
            "c",
            workload_key="k",
            model_name="m",
            hardware="cpu",
            workload={},
            wall_seconds=1,
            max_experiments=0,
            agents=[],
        ).event_id
        != records.submitted(
            "c",
            workload_key="k",
            model_name="m",
            hardware="cpu",
            workload={},
            wall_seconds=1,
            max_experiments=0,
            agents=[],
        ).event_id
    )


def test_row_to_summary() -> None:
    m = from_row(
        {
            "compilation_id": "c1",
            "team": "search",
            "workload_key": "wk-1",
            "model_name": "m",
            "hardware": "cpu",
            "status": "running",
            "budget_wall_seconds": 60.0,
            "budget_max_experiments": 5,
            "experiments_done": 3,
            "failures": 1,
            "baseline_tokens_per_s": 100.0,
            "best_candidate_id": "abc",
            "best_tokens_per_s": 150.0,
            "speedup": 1.5,
            "reason": "",
            "created_at": "2026-01-01T00:00:00+00:00",
            "updated_at": "2026-01-01T00:00:01+00:00",
            "last_position": 9,
        }
    )
    assert m.status == compiler_pb2.COMPILATION_STATUS_RUNNING and m.best.speedup == 1.5
    assert m.workload.hardware.name == "cpu" and m.updated_at.seconds - m.created_at.seconds == 1
