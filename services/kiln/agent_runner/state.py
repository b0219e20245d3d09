"""A compilation's state as its own stream (``compilation-<id>``) records it.

Built by folding the stream's events in version order; the runner keeps folding the events it
appends (and any it finds on an optimistic-concurrency conflict, such as a cancel request), so
after a restart the same fold gives the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kiln.agent_runner.experiment import (
    Completed,
    Requested,
    event_data,
    experiment_id_of,
    recorded_at,
)
from kiln.agent_runner.records import COMPILATION_PREFIX, stream_suffix
from kiln.agent_runner.workload import workload_from_json
from kiln.v1 import common_pb2, ledger_pb2


@dataclass(frozen=True)
class Baseline:
    """The reference forward's measurement: tokens/s and median step time (ms)."""

    experiment_id: str
    candidate_id: str
    tokens_per_s: float
    median_ms: float


@dataclass(frozen=True)
class Best:
    """The best confirmed candidate so far (full tier) and its speedup over the reference
    measured on the full tier next to it."""

    experiment_id: str
    candidate_id: str
    tokens_per_s: float
    median_ms: float
    speedup: float


@dataclass
class ExperimentRecord:
    """One experiment of the compilation: its request and, once known, its completion."""

    requested: Requested
    completed: Completed | None = None


@dataclass
class CompilationState:
    """What the compilation stream says (plus the experiments, filled in by the runner).

    Attributes:
        compilation_id, team: the compilation and the team that submitted it.
        workload: the submitted workload (with its key).
        wall_seconds, max_experiments: the budget (0 experiments = no limit).
        agents: agent names asked for (empty = the default set).
        baselines: baselines of :mod:`kiln.baselines` to measure beside the search.
        compared: baseline names with a ``BaselineCompared`` recorded.
        submitted_at: ledger time of the submission (the wall budget's origin).
        submitted_position: global position of the submission.
        version: the stream's last version folded.
        plan: the chosen ``ParallelismPlan`` as JSON, once planned.
        baseline: the reference's fast-tier measurement, once known.
        best: the best candidate confirmed on the full tier, once there is one.
        tier_agreement: (n, rho) once ``TierAgreement`` is recorded.
        cancel_reason: set once a cancel was requested.
        end_status, end_reason: set once ended.
        experiments: experiment id -> record (the runner's, not the stream's).
    """

    compilation_id: str
    team: str
    workload: common_pb2.Workload
    wall_seconds: float
    max_experiments: int
    agents: list[str]
    submitted_at: datetime
    submitted_position: int
    version: int = 1
    plan: dict[str, Any] | None = None
    baseline: Baseline | None = None
    best: Best | None = None
    tier_agreement: tuple[int, float | None] | None = None
    cancel_reason: str | None = None
    end_status: str | None = None
    end_reason: str = ""
    experiments: dict[str, ExperimentRecord] = field(default_factory=dict)
    baselines: list[str] = field(default_factory=list)
    compared: set[str] = field(default_factory=set)

    @property
    def workload_key(self) -> str:
        """The workload key."""
        return self.workload.workload_key

    @property
    def ended(self) -> bool:
        """True once CompilationEnded is folded."""
        return self.end_status is not None

    @staticmethod
    def from_events(events: list[ledger_pb2.RecordedEvent]) -> CompilationState:
        """Fold a compilation stream.

        Raises:
            ValueError: the stream does not start with CompilationSubmitted.
        """
        if not events or events[0].type != "CompilationSubmitted":
            raise ValueError("a compilation stream starts with CompilationSubmitted")
        first = events[0]
        cid = stream_suffix(first.stream_id, COMPILATION_PREFIX)
        if cid is None:
            raise ValueError(f"{first.stream_id!r} is not a compilation stream")
        d = event_data(first)
        state = CompilationState(
            compilation_id=cid,
            team=first.metadata.team,
            workload=workload_from_json(d["workload"]),
            wall_seconds=float(d["budget"]["wall_seconds"]),
            max_experiments=int(d["budget"].get("max_experiments", 0)),
            agents=list(d.get("agents", [])),
            submitted_at=recorded_at(first),
            submitted_position=first.position,
            version=first.stream_version,
            baselines=list(d.get("baselines", [])),
        )
        for event in events[1:]:
            state.apply(event)
        return state

    def apply(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one later event of the stream (versions already folded are ignored)."""
        self.apply_data(event.type, event_data(event), event.stream_version)

    def apply_experiment(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one of this compilation's ``ExperimentRequested`` / ``ExperimentCompleted``
        events (read from its experiment stream) into :attr:`experiments`; a completion
        without its request, or after the first, is ignored."""
        eid = experiment_id_of(event)
        if eid is None:
            return
        if event.type == "ExperimentRequested":
            self.experiments[eid] = ExperimentRecord(Requested.from_event(event))
        elif event.type == "ExperimentCompleted":
            record = self.experiments.get(eid)
            if record is not None and record.completed is None:
                record.completed = Completed.from_event(event)

    def apply_data(self, event_type: str, d: dict[str, Any], version: int) -> None:
        """Fold an event given by type, payload and stream version (e.g. one just appended)."""
        if version <= self.version:
            return
        self.version = version
        if event_type == "CompilationPlanned":
            self.plan = dict(d["plan"])
        elif event_type == "BaselineMeasured":
            self.baseline = Baseline(
                d["experiment_id"],
                d["candidate_id"],
                float(d["tokens_per_s"]),
                float(d["median_ms"]),
            )
        elif event_type == "BestCandidateImproved":
            self.best = Best(
                d["experiment_id"],
                d["candidate_id"],
                float(d["tokens_per_s"]),
                float(d["median_ms"]),
                float(d["speedup"]),
            )
        elif event_type == "BaselineCompared":
            self.compared.add(str(d["name"]))
        elif event_type == "TierAgreement":
            rho = d.get("rho")
            self.tier_agreement = (int(d["n"]), None if rho is None else float(rho))
        elif event_type == "CompilationCancelRequested":
            self.cancel_reason = d.get("reason") or "cancel requested"
        elif event_type == "CompilationEnded":
            self.end_status = str(d["status"])
            self.end_reason = d.get("reason", "")
