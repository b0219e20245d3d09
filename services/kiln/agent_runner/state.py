"""A compilation's state as the runner keeps it: the stream's fold plus the runner's records.

The stream folds through :class:`kiln.domain.compilation.Compilation`, including the events the
runner appends or finds on a conflict, so after a restart the same fold gives the same state.
:attr:`CompilationState.experiments` are the runner's records of its experiments.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kiln.agent_runner.experiment import domain_event, recorded_at
from kiln.agent_runner.workload import workload_from_json
from kiln.domain.compilation import (
    CANCEL_DEFAULT_REASON,
    EXPERIMENT_COMPLETED,
    Baseline,
    Best,
    Compilation,
    Event,
)
from kiln.domain.experiment import ExperimentRecord, fold_experiment
from kiln.domain.reuse import REUSED, reused_record
from kiln.v1 import common_pb2, ledger_pb2

__all__ = ["Baseline", "Best", "CompilationState", "ExperimentRecord"]


class CompilationState:
    """What the compilation stream says (read through :attr:`compilation`, the aggregate) plus
    ``experiments``: experiment id -> the runner's record, and ``workload``, the submitted
    message.
    """

    def __init__(
        self,
        compilation_id: str,
        team: str,
        workload: common_pb2.Workload,
        wall_seconds: float,
        max_experiments: int,
        agents: list[str],
        submitted_at: datetime,
        submitted_position: int,
        version: int = 1,
        *,
        baseline: Baseline | None = None,
        best: Best | None = None,
        baselines: list[str] | None = None,
        compilation: Compilation | None = None,
    ) -> None:
        self.workload = workload
        self.experiments: dict[str, ExperimentRecord] = {}
        self.compilation = compilation or Compilation(
            compilation_id=compilation_id,
            team=team,
            workload={},
            workload_key=workload.workload_key,
            model_name=workload.model.name,
            hardware=workload.hardware.name,
            wall_seconds=float(wall_seconds),
            max_experiments=max_experiments,
            submitted_at=submitted_at,
            submitted_position=submitted_position,
            agents=list(agents),
            baselines=list(baselines or []),
            version=version,
            position=submitted_position,
            baseline=baseline,
            best=best,
        )

    @staticmethod
    def from_events(events: list[ledger_pb2.RecordedEvent]) -> CompilationState:
        """Fold a compilation stream (in version order).

        Raises:
            ValueError: the stream does not start with CompilationSubmitted or breaks the status
                machine.
            KeyError: a payload misses a required field.
        """
        if not events:
            raise ValueError("a compilation stream starts with CompilationSubmitted")
        first = domain_event(events[0])
        comp = Compilation.submitted(first)
        state = CompilationState(
            comp.compilation_id,
            comp.team,
            workload_from_json(dict(first.data["workload"])),
            comp.wall_seconds,
            comp.max_experiments,
            comp.agents,
            comp.submitted_at,
            comp.submitted_position,
            compilation=comp,
        )
        for event in events[1:]:
            state.apply(event)
        return state

    # ------------------------------------------------------------------ folding
    def apply(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one later event of the stream (versions already folded are ignored); a
        ``MeasurementReused`` also adds its record to :attr:`experiments`."""
        if self.compilation.apply(domain_event(event)) and event.type == REUSED:
            self._reused(domain_event(event).data, event.position, recorded_at(event))

    def apply_data(
        self,
        event_type: str,
        d: dict[str, Any],
        version: int,
        position: int = 0,
        at: datetime | None = None,
    ) -> None:
        """Fold an event given by type, payload, stream version and, when known, its global
        position and time (e.g. one just appended)."""
        event = Event(event_type, d, self.compilation.stream_id, version, position, at)
        if self.compilation.apply(event) and event_type == REUSED:
            self._reused(d, position, at or datetime.now(UTC))

    def _reused(self, d: Any, position: int, at: datetime) -> None:
        rec = reused_record(d, position, at, self.team)
        self.experiments.setdefault(rec.requested.experiment_id, rec)

    def own(self, rec: ExperimentRecord) -> bool:
        """Whether an experiment was measured for this compilation (not a reused one)."""
        return rec.requested.compilation_id == self.compilation_id

    def apply_experiment(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one of this compilation's ``ExperimentRequested`` / ``ExperimentCompleted`` into
        :attr:`experiments` (a completion without its request, or after the first, is ignored)
        and count a completion in :attr:`compilation`.
        """
        ev = domain_event(event)
        fold_experiment(self.experiments, ev)
        if ev.type == EXPERIMENT_COMPLETED and self.compilation.belongs(ev):
            self.compilation.apply(ev)

    # ------------------------------------------------------------------ the aggregate's facts
    @property
    def compilation_id(self) -> str:
        return self.compilation.compilation_id

    @property
    def team(self) -> str:
        return self.compilation.team

    @property
    def workload_key(self) -> str:
        return self.workload.workload_key

    @property
    def wall_seconds(self) -> float:
        """The wall-clock budget (s)."""
        return self.compilation.wall_seconds

    @property
    def max_experiments(self) -> int:
        """The experiment budget (0 = no limit)."""
        return self.compilation.max_experiments

    @property
    def agents(self) -> list[str]:
        """Agent names asked for (empty = the default set)."""
        return self.compilation.agents

    @property
    def baselines(self) -> list[str]:
        """Baselines of :mod:`kiln.baselines` to measure beside the search."""
        return self.compilation.baselines

    @property
    def submitted_at(self) -> datetime:
        """Ledger time of the submission (UTC)."""
        return self.compilation.submitted_at

    @property
    def submitted_position(self) -> int:
        """Global position of the submission."""
        return self.compilation.submitted_position

    @property
    def version(self) -> int:
        """The stream's last version folded."""
        return self.compilation.version

    @property
    def plan(self) -> dict[str, Any] | None:
        """The chosen ``ParallelismPlan`` as JSON, once planned."""
        return self.compilation.plan

    @property
    def baseline(self) -> Baseline | None:
        """The reference's fast-tier measurement, once known."""
        return self.compilation.baseline

    @baseline.setter
    def baseline(self, value: Baseline | None) -> None:
        self.compilation.baseline = value

    @property
    def best(self) -> Best | None:
        """The best candidate confirmed on the full tier, once there is one."""
        return self.compilation.best

    @best.setter
    def best(self, value: Best | None) -> None:
        self.compilation.best = value

    @property
    def tier_agreement(self) -> tuple[int, float | None] | None:
        """(n, rho) once ``TierAgreement`` is recorded."""
        return self.compilation.tier_agreement

    @property
    def compared(self) -> set[str]:
        """Baseline names with a ``BaselineCompared`` recorded."""
        return self.compilation.compared

    @property
    def cancel_reason(self) -> str | None:
        """Set once a cancel was requested (its reason, else "cancel requested"); None before."""
        reason = self.compilation.cancel_reason
        return None if reason is None else (reason or CANCEL_DEFAULT_REASON)

    @cancel_reason.setter
    def cancel_reason(self, value: str | None) -> None:
        self.compilation.cancel_reason = value

    @property
    def end_status(self) -> str | None:
        """succeeded | cancelled | failed once ended, else None."""
        return str(self.compilation.status) if self.compilation.ended else None

    @property
    def end_reason(self) -> str:
        """The ``CompilationEnded`` reason ("" before)."""
        return self.compilation.end_reason

    @property
    def ended(self) -> bool:
        """True once CompilationEnded is folded."""
        return self.compilation.ended
