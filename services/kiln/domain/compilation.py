"""The compilation aggregate: one fold of a compilation's events, the status machine and the
counters defined once.

Input: the events (:class:`Event`) of the ``compilation-<id>`` stream and its experiments'
``ExperimentRequested`` / ``ExperimentCompleted``.

Status: ``CompilationSubmitted`` -> pending; ``CompilationPlanned`` or ``BaselineMeasured`` ->
running (from pending only); ``CompilationEnded`` -> succeeded | cancelled | failed (from pending
or running only). Counters: an experiment's first ``ExperimentCompleted`` counts in
``experiments_done`` unless cancelled, in ``failures`` unless ok or cancelled.

Replay is idempotent: a compilation event at or below :attr:`version` is ignored, a completion
counts once. Errors: :class:`IllegalTransition` for a second submission or end; ``ValueError``
for another compilation's event or an unknown end status; ``KeyError`` for a missing field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from kiln.domain import streams
from kiln.events.types import is_counted, is_failure

SUBMITTED = "CompilationSubmitted"
EXPERIMENT_REQUESTED = "ExperimentRequested"
EXPERIMENT_COMPLETED = "ExperimentCompleted"
COMPILATION_TYPES = (
    SUBMITTED,
    "CompilationPlanned",
    "BaselineMeasured",
    "BaselineCompared",
    "BestCandidateImproved",
    "TierAgreement",
    "MeasurementReused",
    "IncumbentCompared",
    "CompilationCancelRequested",
    "CompilationEnded",
)
"""Event types of the ``compilation-<id>`` stream."""
EXPERIMENT_TYPES = (EXPERIMENT_REQUESTED, EXPERIMENT_COMPLETED)
"""Event types of an ``experiment-<id>`` stream."""
CANCEL_DEFAULT_REASON = "cancel requested"


class Status(StrEnum):
    """A compilation's status, as the ledger and the projection write it."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        """True for succeeded, cancelled and failed."""
        return self in END_STATUSES


END_STATUSES = frozenset({Status.SUCCEEDED, Status.CANCELLED, Status.FAILED})
OPEN_STATUSES = (Status.PENDING, Status.RUNNING)
"""Statuses of a compilation that has not ended."""


class IllegalTransition(ValueError):
    """An event the status machine does not allow (a second submission or end)."""


@dataclass(frozen=True)
class Event:
    """One recorded event as the fold reads it: ``version`` in its stream (from 1), global
    ``position`` (0 when unknown), ``recorded_at`` (UTC or None), the appending call's ``team``.
    """

    type: str
    data: Mapping[str, Any]
    stream_id: str
    version: int
    position: int = 0
    recorded_at: datetime | None = None
    team: str = ""


@dataclass(frozen=True)
class Baseline:
    """The reference forward's measurement: tokens/s and median step time (ms)."""

    experiment_id: str
    candidate_id: str
    tokens_per_s: float
    median_ms: float


@dataclass(frozen=True)
class Best:
    """The best confirmed candidate, its speedup over the reference measured next to it
    (``reference_*``) and its tier.
    """

    experiment_id: str
    candidate_id: str
    tokens_per_s: float
    median_ms: float
    speedup: float
    tier: str = ""
    reference_experiment_id: str = ""
    reference_tokens_per_s: float = 0.0
    found_at: datetime | None = None


@dataclass
class Compilation:
    """One compilation as its events say.

    Attributes:
        workload: the ``kiln.v1.Workload`` as JSON, with its key, model name and hardware.
        wall_seconds, max_experiments: the budget (0 experiments = no limit).
        agents, baselines: agent names (empty = default set) and baselines asked for.
        version: the compilation stream's last version folded; position: the highest global one.
        plan: the ``ParallelismPlan`` as JSON, once planned.
        started_at: when it left pending (the ``recorded_at`` of its ``CompilationPlanned`` or
            ``BaselineMeasured``), None before; the wall-clock budget runs from here.
        tier_agreement: (n, rho). compared: baseline names recorded.
        cancel_reason: the cancel request's reason (None: no request; may be "").
        seeds: the warm start's resolved seeds (``Seed`` payloads, best first); incumbent: the
            resolved incumbent (``Incumbent`` payload) or None; incumbent_compared: the
            ``IncumbentCompared`` payload once recorded; reused: ``MeasurementReused`` events.
    """

    compilation_id: str
    team: str
    workload: dict[str, Any]
    workload_key: str
    model_name: str
    hardware: str
    wall_seconds: float
    max_experiments: int
    submitted_at: datetime
    submitted_position: int = 0
    agents: list[str] = field(default_factory=list)
    baselines: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    version: int = 1
    position: int = 0
    updated_at: datetime | None = None
    started_at: datetime | None = None
    plan: dict[str, Any] | None = None
    baseline: Baseline | None = None
    best: Best | None = None
    tier_agreement: tuple[int, float | None] | None = None
    compared: set[str] = field(default_factory=set)
    cancel_reason: str | None = None
    seeds: list[dict[str, Any]] = field(default_factory=list)
    incumbent: dict[str, Any] | None = None
    incumbent_compared: dict[str, Any] | None = None
    reused: int = 0
    end_reason: str = ""
    outcome: str = ""
    """What the search came to (``CompilationEnded.outcome``; "" before the end and in older
    events)."""
    experiments_done: int = 0
    failures: int = 0
    counted: set[str] = field(default_factory=set)
    """Experiment ids whose completion is counted."""

    @staticmethod
    def submitted(event: Event) -> Compilation:
        """A compilation from its ``CompilationSubmitted``; ValueError if it is not one or has no
        time, KeyError for a missing field.
        """
        cid = streams.compilation_id_in(event.stream_id)
        if event.type != SUBMITTED or cid is None:
            raise ValueError("a compilation stream starts with CompilationSubmitted")
        if event.recorded_at is None:
            raise ValueError("CompilationSubmitted without its recorded_at")
        d = event.data
        budget = d["budget"]
        return Compilation(
            compilation_id=cid,
            team=event.team,
            workload=dict(d["workload"]),
            workload_key=str(d["workload_key"]),
            model_name=str(d.get("model_name", "")),
            hardware=str(d.get("hardware", "")),
            wall_seconds=float(budget["wall_seconds"]),
            max_experiments=int(budget.get("max_experiments", 0)),
            submitted_at=event.recorded_at,
            submitted_position=event.position,
            agents=list(d.get("agents", [])),
            baselines=list(d.get("baselines", [])),
            seeds=[dict(x) for x in d.get("seeds") or []],
            incumbent=dict(d["incumbent"]) if d.get("incumbent") else None,
            version=event.version,
            position=event.position,
            updated_at=event.recorded_at,
        )

    @property
    def stream_id(self) -> str:
        """``compilation-<id>``."""
        return streams.compilation_stream(self.compilation_id)

    @property
    def ended(self) -> bool:
        """True once ``CompilationEnded`` is folded."""
        return self.status.ended

    @property
    def reason(self) -> str:
        """What a reader is told: the end's reason, else the cancel request's, else ""."""
        return self.end_reason or self.cancel_reason or ""

    def belongs(self, event: Event) -> bool:
        """True when ``event`` is part of this compilation's story."""
        if event.stream_id == self.stream_id:
            return True
        return (
            event.type in EXPERIMENT_TYPES
            and streams.experiment_id_in(event.stream_id) is not None
            and event.data.get("compilation_id") == self.compilation_id
        )

    def apply(self, event: Event) -> bool:
        """Fold one event; False when it was already folded. Raises as the module docstring says."""
        if event.stream_id == self.stream_id:
            if event.version <= self.version:
                return False
            if event.type == SUBMITTED:
                raise IllegalTransition(f"{self.stream_id} is submitted twice")
            self._fold_own(event.type, event.data, event.recorded_at)
            self.version = event.version
        elif self.belongs(event):
            eid = streams.experiment_id_in(event.stream_id)
            if event.type == EXPERIMENT_COMPLETED and eid is not None:
                if not self.count(eid, str(event.data["status"])):
                    return False
        else:
            raise ValueError(f"{event.type} on {event.stream_id} is not {self.stream_id}'s")
        self.position = max(self.position, event.position)
        if event.recorded_at is not None:
            self.updated_at = event.recorded_at
        return True

    def count(self, experiment_id: str, status: str) -> bool:
        """Count an experiment's completion with ``status`` (False: counted already)."""
        if experiment_id in self.counted:
            return False
        self.counted.add(experiment_id)
        self.experiments_done += int(is_counted(status))
        self.failures += int(is_failure(status))
        return True

    def _fold_own(self, t: str, d: Mapping[str, Any], at: datetime | None) -> None:
        if t == "CompilationPlanned":
            self.plan = dict(d["plan"])
            self._start(at)
        elif t == "BaselineMeasured":
            self.baseline = Baseline(
                str(d["experiment_id"]),
                str(d["candidate_id"]),
                float(d["tokens_per_s"]),
                float(d["median_ms"]),
            )
            self._start(at)
        elif t == "BestCandidateImproved":
            self.best = Best(
                str(d["experiment_id"]),
                str(d["candidate_id"]),
                float(d["tokens_per_s"]),
                float(d["median_ms"]),
                float(d["speedup"]),
                tier=str(d.get("tier", "")),
                reference_experiment_id=str(d.get("reference_experiment_id", "")),
                reference_tokens_per_s=float(d.get("reference_tokens_per_s", 0.0)),
                found_at=at,
            )
        elif t == "BaselineCompared":
            self.compared.add(str(d["name"]))
        elif t == "MeasurementReused":
            self.reused += 1
        elif t == "IncumbentCompared":
            self.incumbent_compared = dict(d)
        elif t == "TierAgreement":
            rho = d.get("rho")
            self.tier_agreement = (int(d["n"]), None if rho is None else float(rho))
        elif t == "CompilationCancelRequested":
            self.cancel_reason = str(d.get("reason", ""))
        elif t == "CompilationEnded":
            self._end(str(d["status"]), str(d.get("reason", "")))
            self.outcome = str(d.get("outcome") or "")

    def _start(self, at: datetime | None) -> None:
        if self.status == Status.PENDING:
            self.status = Status.RUNNING
            self.started_at = at

    def _end(self, status: str, reason: str) -> None:
        try:
            end = Status(status)
        except ValueError:
            raise ValueError(f"unknown end status {status!r}") from None
        if end not in END_STATUSES:
            raise ValueError(f"{status!r} is not an end status")
        if self.ended:
            raise IllegalTransition(f"{self.stream_id} ends twice ({self.status}, then {end})")
        self.status = end
        self.end_reason = reason
