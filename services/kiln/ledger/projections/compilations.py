"""Projection: one row per compilation (status, counters, baseline, best so far).

The row is the persisted summary of the domain aggregate
(:class:`kiln.domain.compilation.Compilation`): each event restores the aggregate from the row,
folds through :meth:`~kiln.domain.compilation.Compilation.apply` (the status machine and the
counting rules) and writes the summary back. The row keeps no stream version: the projector's
checkpoint is what folds each event once.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kiln.domain import streams
from kiln.domain.compilation import Baseline, Best, Compilation, Event, Status
from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.base import Projection, Row, Rows


def domain_event(event: StoredEvent) -> Event:
    """A stored event as the domain folds read it."""
    return Event(
        type=event.type,
        data=event.data,
        stream_id=event.stream_id,
        version=event.stream_version,
        position=event.position,
        recorded_at=event.recorded_at,
        team=str(event.metadata.get("team") or ""),
    )


def _restore(row: Row) -> Compilation:
    """The aggregate a row summarizes (stream version unknown: 0)."""
    status = Status(row["status"])
    reason = str(row.get("reason") or "")
    tps = row.get("baseline_tokens_per_s")
    best_id = row.get("best_candidate_id")
    created: datetime = row["created_at"]
    return Compilation(
        compilation_id=row["compilation_id"],
        team=row["team"],
        workload={},
        workload_key=row["workload_key"],
        model_name=row["model_name"],
        hardware=row["hardware"],
        wall_seconds=float(row["budget_wall_seconds"]),
        max_experiments=int(row["budget_max_experiments"]),
        submitted_at=created,
        status=status,
        version=0,
        position=int(row["last_position"]),
        updated_at=row["updated_at"],
        baseline=None if tps is None else Baseline("", "", float(tps), 0.0),
        best=None
        if not best_id
        else Best("", best_id, float(row["best_tokens_per_s"]), 0.0, float(row["speedup"])),
        cancel_reason=None if status.ended else (reason or None),
        end_reason=reason if status.ended else "",
        experiments_done=int(row["experiments_done"]),
        failures=int(row["failures"]),
    )


def _row(c: Compilation) -> dict[str, Any]:
    return {
        "compilation_id": c.compilation_id,
        "team": c.team,
        "workload_key": c.workload_key,
        "model_name": c.model_name,
        "hardware": c.hardware,
        "status": str(c.status),
        "budget_wall_seconds": c.wall_seconds,
        "budget_max_experiments": c.max_experiments,
        "experiments_done": c.experiments_done,
        "failures": c.failures,
        "baseline_tokens_per_s": None if c.baseline is None else c.baseline.tokens_per_s,
        "best_candidate_id": None if c.best is None else c.best.candidate_id,
        "best_tokens_per_s": None if c.best is None else c.best.tokens_per_s,
        "speedup": None if c.best is None else c.best.speedup,
        "reason": c.reason,
        "created_at": c.submitted_at,
        "updated_at": c.updated_at,
        "last_position": c.position,
    }


class CompilationsProjection(Projection):
    """``proj_compilations``: status pending → running → succeeded | cancelled | failed."""

    name = "compilations"
    key = "compilation_id"
    created = "created_at"
    handles = frozenset(
        {
            "CompilationSubmitted",
            "CompilationPlanned",
            "BaselineMeasured",
            "BestCandidateImproved",
            "CompilationCancelRequested",
            "CompilationEnded",
            "ExperimentCompleted",
        }
    )

    def key_of(self, event: StoredEvent) -> str | None:
        if event.type == "ExperimentCompleted":
            return str(event.data["compilation_id"])
        return streams.compilation_id_in(event.stream_id)

    def apply(self, rows: Rows, event: StoredEvent) -> None:
        key = self.key_of(event)
        if key is None:
            return
        if event.type == "CompilationSubmitted":
            rows[key] = _row(Compilation.submitted(domain_event(event)))
            return
        row = rows.get(key)
        if row is None:  # an event for a compilation this ledger never saw submitted
            return
        compilation = _restore(row)
        if compilation.apply(domain_event(event)):
            row.update(_row(compilation))
