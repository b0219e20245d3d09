"""The compilation aggregate (kiln.domain.compilation) and stream names (kiln.domain.streams):
transitions, illegal transitions, counters, idempotent replay, and that the snapshot and the
compilations projection fold the same story to the same status and counters."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kiln.domain import streams
from kiln.domain.compilation import Compilation, Event, IllegalTransition, Status

CID = "c1"
STREAM = streams.compilation_stream(CID)
T0 = datetime(2026, 1, 1, tzinfo=UTC)

SUBMITTED = {
    "workload_key": "wk-1",
    "model_name": "m",
    "hardware": "cpu",
    "workload": {"model": {"name": "m"}, "hardware": {"name": "cpu"}},
    "budget": {"wall_seconds": 60.0, "max_experiments": 5},
    "agents": ["random"],
}


class _Story:
    """Events with consecutive positions and per-stream versions."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._versions: dict[str, int] = {}

    def add(self, stream: str, type_: str, data: dict[str, Any]) -> Event:
        self._versions[stream] = self._versions.get(stream, 0) + 1
        n = len(self.events) + 1
        event = Event(
            type_, data, stream, self._versions[stream], n, T0 + timedelta(seconds=n), "search"
        )
        self.events.append(event)
        return event

    def own(self, type_: str, data: dict[str, Any] | None = None) -> Event:
        return self.add(STREAM, type_, data or {})

    def experiment(self, eid: str, status: str, tps: float = 0.0) -> None:
        stream = streams.experiment_stream(eid)
        self.add(stream, "ExperimentRequested", {"compilation_id": CID, "candidate_id": eid})
        self.add(
            stream,
            "ExperimentCompleted",
            {"compilation_id": CID, "status": status, "tokens_per_s": tps},
        )


def _story(end: str = "succeeded") -> _Story:
    s = _Story()
    s.own("CompilationSubmitted", SUBMITTED)
    s.own("CompilationPlanned", {"plan": {"tp": 1}})
    s.experiment("e0", "ok", 100.0)
    s.own(
        "BaselineMeasured",
        {"experiment_id": "e0", "candidate_id": "ref", "tokens_per_s": 100.0, "median_ms": 10.0},
    )
    s.experiment("e1", "ok", 150.0)
    s.experiment("e2", "incorrect")
    s.experiment("e3", "cancelled")
    s.own(
        "BestCandidateImproved",
        {
            "experiment_id": "e1",
            "candidate_id": "fast",
            "tokens_per_s": 150.0,
            "median_ms": 6.0,
            "speedup": 1.5,
            "tier": "full",
            "reference_experiment_id": "e0",
            "reference_tokens_per_s": 100.0,
        },
    )
    s.own("TierAgreement", {"n": 2, "rho": 0.5})
    s.own("CompilationEnded", {"status": end, "reason": "budget spent"})
    return s


def _fold(events: list[Event]) -> Compilation:
    comp = Compilation.submitted(events[0])
    for event in events[1:]:
        comp.apply(event)
    return comp


def test_submission_planning_and_end_move_the_status() -> None:
    events = _story().events
    comp = Compilation.submitted(events[0])
    assert comp.status == Status.PENDING and not comp.ended
    assert (comp.compilation_id, comp.team, comp.workload_key) == (CID, "search", "wk-1")
    assert (comp.wall_seconds, comp.max_experiments, comp.submitted_at) == (
        60.0,
        5,
        T0 + timedelta(seconds=1),
    )
    comp.apply(events[1])
    assert comp.status == Status.RUNNING and comp.plan == {"tp": 1}
    for event in events[2:]:
        comp.apply(event)
    assert comp.status == Status.SUCCEEDED and comp.ended and comp.reason == "budget spent"
    assert comp.baseline is not None and comp.baseline.tokens_per_s == 100.0
    assert comp.best is not None and comp.best.speedup == 1.5 and comp.best.tier == "full"
    assert comp.best.reference_experiment_id == "e0" and comp.best.found_at is not None
    assert comp.tier_agreement == (2, 0.5)
    assert comp.version == 6 and comp.position == len(events)
    assert comp.updated_at == events[-1].recorded_at


def test_a_baseline_without_a_plan_starts_it_and_an_end_from_pending_is_allowed() -> None:
    s = _Story()
    comp = Compilation.submitted(s.own("CompilationSubmitted", SUBMITTED))
    comp.apply(
        s.own(
            "BaselineMeasured",
            {"experiment_id": "e0", "candidate_id": "r", "tokens_per_s": 1.0, "median_ms": 1.0},
        )
    )
    assert comp.status == Status.RUNNING
    other = Compilation.submitted(_Story().own("CompilationSubmitted", SUBMITTED))
    other.apply(Event("CompilationEnded", {"status": "failed", "reason": "no plan"}, STREAM, 2))
    assert other.status == Status.FAILED and other.reason == "no plan"


def test_data_after_the_end_leaves_the_status() -> None:
    s = _story("failed")
    comp = _fold(s.events)
    comp.apply(s.own("CompilationPlanned", {"plan": {"tp": 2}}))
    assert comp.status == Status.FAILED and comp.plan == {"tp": 2}


def test_cancel_reason_is_kept_when_the_end_gives_none() -> None:
    s = _Story()
    comp = Compilation.submitted(s.own("CompilationSubmitted", SUBMITTED))
    assert comp.cancel_reason is None and comp.reason == ""
    comp.apply(s.own("CompilationCancelRequested", {"reason": "enough"}))
    assert comp.cancel_reason == "enough" and comp.reason == "enough" and not comp.ended
    comp.apply(s.own("CompilationEnded", {"status": "cancelled", "reason": ""}))
    assert comp.status == Status.CANCELLED and comp.reason == "enough"


def test_a_second_end_is_illegal() -> None:
    s = _story()
    comp = _fold(s.events)
    with pytest.raises(IllegalTransition, match="ends twice"):
        comp.apply(s.own("CompilationEnded", {"status": "failed"}))
    assert comp.status == Status.SUCCEEDED


def test_a_second_submission_is_illegal() -> None:
    s = _Story()
    comp = Compilation.submitted(s.own("CompilationSubmitted", SUBMITTED))
    with pytest.raises(IllegalTransition, match="submitted twice"):
        comp.apply(s.own("CompilationSubmitted", SUBMITTED))
    assert isinstance(IllegalTransition("x"), ValueError)


@pytest.mark.parametrize("status", ["done", "pending", "running"])
def test_an_unknown_end_status_is_refused(status: str) -> None:
    s = _Story()
    comp = Compilation.submitted(s.own("CompilationSubmitted", SUBMITTED))
    with pytest.raises(ValueError, match="status"):
        comp.apply(s.own("CompilationEnded", {"status": status}))
    assert comp.status == Status.PENDING


def test_a_stream_must_start_with_its_submission() -> None:
    with pytest.raises(ValueError, match="starts with CompilationSubmitted"):
        Compilation.submitted(Event("CompilationPlanned", {"plan": {}}, STREAM, 1, 1, T0))
    with pytest.raises(ValueError, match="starts with CompilationSubmitted"):
        Compilation.submitted(Event("CompilationSubmitted", SUBMITTED, "experiment-x", 1, 1, T0))


def test_another_compilations_events_are_refused() -> None:
    comp = _fold(_story().events)
    foreign = Event(
        "ExperimentCompleted", {"compilation_id": "c2", "status": "ok"}, "experiment-z", 2
    )
    assert not comp.belongs(foreign)
    with pytest.raises(ValueError, match="not compilation-c1's"):
        comp.apply(foreign)
    with pytest.raises(ValueError):
        comp.apply(Event("CompilationPlanned", {"plan": {}}, "compilation-c2", 9))


def test_counters_count_completions_once_and_by_status() -> None:
    s = _story()
    comp = _fold(s.events)
    assert (comp.experiments_done, comp.failures) == (3, 1)  # ok, ok, incorrect; not cancelled
    again = s.add("experiment-e2", "ExperimentCompleted", {"compilation_id": CID, "status": "ok"})
    assert comp.apply(again) is False  # a second completion of e2
    assert (comp.experiments_done, comp.failures) == (3, 1)
    for status in ("crashed", "timed_out", "rejected"):
        s.experiment(f"x-{status}", status)
        comp.apply(s.events[-2])
        comp.apply(s.events[-1])
    assert (comp.experiments_done, comp.failures) == (6, 4)


def test_replaying_the_story_changes_nothing() -> None:
    events = _story().events
    once = _fold(events)
    twice = _fold(events)
    assert [twice.apply(e) for e in events if e.stream_id == STREAM] == [False] * 6
    assert all(not twice.apply(e) for e in events if e.type == "ExperimentCompleted")
    assert replace(twice, updated_at=once.updated_at) == once
    assert (twice.status, twice.experiments_done, twice.failures) == (Status.SUCCEEDED, 3, 1)


def test_stream_names_round_trip() -> None:
    assert streams.compilation_stream("a1") == "compilation-a1"
    assert streams.experiment_stream("e-9") == "experiment-e-9"
    assert streams.compilation_id_in("compilation-a1") == "a1"
    assert streams.experiment_id_in("experiment-e-9") == "e-9"
    assert streams.compilation_id_in("experiment-e-9") is None
    assert streams.stream_suffix("x-1", "y-") is None
    assert streams.CATEGORIES == ("compilation", "experiment", "deployment")


def test_the_domain_imports_no_service_dependency() -> None:
    code = (
        "import sys, kiln.domain.compilation, kiln.domain.streams\n"
        "roots = ('grpc', 'google', 'sqlalchemy', 'nats', 'torch')\n"
        "layers = ('kiln.v1', 'kiln.ledger', 'kiln.agent_runner', 'kiln.engine_pool', 'kiln.cli')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in roots or m.startswith(layers)]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_snapshot_and_projection_fold_the_same_story_alike() -> None:
    from kiln.agent_runner.snapshot import NAME_BY_STATUS, Snapshot
    from kiln.ledger.model import StoredEvent
    from kiln.ledger.projections.compilations import CompilationsProjection
    from kiln.ledger.tables import proj_compilations
    from kiln.v1 import ledger_pb2

    snap, projection = Snapshot(CID), CompilationsProjection(proj_compilations)
    rows: dict[str, dict[str, Any]] = {}
    for e in _story("cancelled").events:
        recorded = ledger_pb2.RecordedEvent(
            position=e.position,
            stream_id=e.stream_id,
            stream_version=e.version,
            type=e.type,
            data=json.dumps(e.data).encode(),
            metadata=ledger_pb2.EventMetadata(team=e.team),
        )
        assert e.recorded_at is not None
        recorded.recorded_at.FromDatetime(e.recorded_at)
        snap.apply(recorded)
        stored = StoredEvent(
            e.position, e.stream_id, e.version, str(e.position), e.type, 1, dict(e.data),
            {"team": e.team}, e.recorded_at,
        )  # fmt: skip
        if e.type in projection.handles:
            projection.apply(rows, stored)
    row, m = rows[CID], snap.message
    assert row["status"] == NAME_BY_STATUS[m.status] == "cancelled"
    assert (row["experiments_done"], row["failures"]) == (m.experiments_done, m.failures) == (3, 1)
    assert row["reason"] == m.reason == "budget spent"
    assert row["best_tokens_per_s"] == m.best.measurement.tokens_per_s == 150.0
    assert row["baseline_tokens_per_s"] == m.baseline.tokens_per_s == 100.0
