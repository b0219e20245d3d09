"""The runner's live counters (experiments done, failures) come from the compilation aggregate,
with the compilations projection's rules: each completion once, ``cancelled`` not counted, a
failure anything but ``ok`` and ``cancelled``. Pure: no services."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, cast

from kiln.agent_runner.budget import ExperimentBudget, WallClock
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.tracker import ExperimentTracker
from kiln.domain.candidate import Candidate
from kiln.domain.compilation import Compilation, Event
from kiln.events.types import ExperimentCompleted
from kiln.v1 import ledger_pb2

from .agent_records import new_state

CID = "c1"
STATUSES = ["ok", "incorrect", "cancelled", "timed_out", "ok"]


def _experiment(n: int, status: str) -> tuple[Requested, Completed]:
    cand = Candidate.make({"threads": n})
    req = Requested(f"e{n}", CID, "search", cand, "random", "fast", 10 * n)
    result = ExperimentCompleted(
        compilation_id=CID,
        candidate_id=cand.id,
        status=status,  # type: ignore[arg-type]
        correct=status == "ok",
        median_ms=1.0,
        tokens_per_s=1000.0,
        engine_id="e",
        tier="fast",
    )
    return req, Completed(f"e{n}", result, 10 * n + 1, datetime.now(UTC))


def _projected() -> Compilation:
    """The projection's fold of the same completions."""
    comp = new_state().compilation
    for n, status in enumerate(STATUSES):
        data: dict[str, Any] = {"compilation_id": CID, "status": status}
        comp.apply(Event("ExperimentCompleted", data, f"experiment-e{n}", 1))
    return comp


class _Dispatcher:
    def forget(self, experiment_id: str) -> None:
        pass


def test_the_runner_counts_completions_through_the_aggregate() -> None:
    state = new_state()
    tracker = ExperimentTracker(
        state, cast(ExperimentDispatcher, _Dispatcher()), RunnerConfig(), {}
    )
    taken = []
    for n, status in enumerate(STATUSES):
        req, completed = _experiment(n, status)
        tracker.in_flight[req.experiment_id] = req
        taken.append(tracker.complete(req, completed))
        assert not tracker.complete(req, completed)  # once
    assert taken == [True] * len(STATUSES) and not tracker.in_flight
    live, projected = state.compilation, _projected()
    assert (live.experiments_done, live.failures) == (4, 2)
    assert (live.experiments_done, live.failures) == (
        projected.experiments_done,
        projected.failures,
    )


def test_a_resumed_state_counts_its_experiments_like_the_projection() -> None:
    state = new_state()
    for n, status in enumerate(STATUSES):
        for kind, body in (("ExperimentRequested", {}), ("ExperimentCompleted", None)):
            req, completed = _experiment(n, status)
            if body is None:
                body = completed.result.model_dump(mode="json")
            else:
                body = {
                    "compilation_id": CID,
                    "candidate_id": req.candidate.id,
                    "candidate": req.candidate.canonical(),
                    "agent": req.agent,
                    "tier": req.tier,
                }
            event = ledger_pb2.RecordedEvent(
                position=10 * n + (kind == "ExperimentCompleted"),
                stream_id=f"experiment-e{n}",
                stream_version=1 + (kind == "ExperimentCompleted"),
                type=kind,
                data=json.dumps(body).encode(),
                metadata=ledger_pb2.EventMetadata(team="search"),
            )
            event.recorded_at.FromDatetime(datetime(2026, 1, 1, tzinfo=UTC))
            state.apply_experiment(event)
            state.apply_experiment(event)  # a replayed event changes nothing
    assert all(r.completed is not None for r in state.experiments.values())
    projected = _projected()
    assert (state.compilation.experiments_done, state.compilation.failures) == (
        projected.experiments_done,
        projected.failures,
    )
    open_ = ExperimentTracker(state, cast(ExperimentDispatcher, _Dispatcher()), RunnerConfig(), {})
    assert not open_.in_flight and len(open_.requested) == len(STATUSES)


def test_budget_end_reasons() -> None:
    spent = ExperimentBudget(limit=2, completed=2)
    assert spent.end_reason() == "the experiment budget is spent (2 of 2 experiments)"
    idle = ExperimentBudget(limit=0, completed=3)
    assert idle.end_reason() == "the agents have nothing left to propose (3 experiments)"
    wall = WallClock(datetime(2026, 1, 1, tzinfo=UTC), 30.0)
    assert wall.end_reason() == "the wall-clock budget of 30 s is spent"
    assert wall.remaining_s(datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)) == 20.0
