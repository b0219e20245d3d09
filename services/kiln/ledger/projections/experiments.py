"""Projection: one row per experiment (proposer, tier, verdict, timing, engine)."""

from __future__ import annotations

from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.base import Projection, Rows


class ExperimentsProjection(Projection):
    """``proj_experiments``: status ``requested`` until completed, then the engine's verdict."""

    name = "experiments"
    key = "experiment_id"
    created = "requested_at"
    handles = frozenset({"ExperimentRequested", "ExperimentCompleted"})

    def key_of(self, event: StoredEvent) -> str | None:
        if event.type not in self.handles:
            return None
        return event.stream_id.partition("-")[2]

    def apply(self, rows: Rows, event: StoredEvent) -> None:
        key = self.key_of(event)
        if key is None:
            return
        d = event.data
        if event.type == "ExperimentRequested":
            rows[key] = {
                "experiment_id": key,
                "compilation_id": d["compilation_id"],
                "candidate_id": d["candidate_id"],
                "agent": d["agent"],
                "tier": d["tier"],
                "status": "requested",
                "correct": None,
                "median_ms": None,
                "tokens_per_s": None,
                "engine_id": None,
                "error": None,
                "requested_at": event.recorded_at,
                "completed_at": None,
                "last_position": event.position,
            }
            return
        row = rows.get(key)
        if row is None:
            return
        row.update(
            status=d["status"],
            correct=bool(d["correct"]),
            median_ms=float(d["median_ms"]),
            tokens_per_s=float(d["tokens_per_s"]),
            engine_id=d.get("engine_id") or None,
            error=d.get("error") or None,
            tier=d["tier"],
            completed_at=event.recorded_at,
            last_position=event.position,
        )
