"""Projection: one row per compilation (status, counters, baseline, best so far)."""

from __future__ import annotations

from kiln.events.types import is_counted, is_failure
from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.base import Projection, Rows

_STATUS_BY_END = {"succeeded": "succeeded", "cancelled": "cancelled", "failed": "failed"}


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
        if event.stream_id.startswith("compilation-"):
            return event.stream_id[len("compilation-") :]
        return None

    def apply(self, rows: Rows, event: StoredEvent) -> None:
        key = self.key_of(event)
        if key is None:
            return
        d = event.data
        if event.type == "CompilationSubmitted":
            rows[key] = {
                "compilation_id": key,
                "team": event.metadata.get("team") or "",
                "workload_key": d["workload_key"],
                "model_name": d["model_name"],
                "hardware": d["hardware"],
                "status": "pending",
                "budget_wall_seconds": float(d["budget"]["wall_seconds"]),
                "budget_max_experiments": int(d["budget"]["max_experiments"]),
                "experiments_done": 0,
                "failures": 0,
                "baseline_tokens_per_s": None,
                "best_candidate_id": None,
                "best_tokens_per_s": None,
                "speedup": None,
                "reason": "",
                "created_at": event.recorded_at,
                "updated_at": event.recorded_at,
                "last_position": event.position,
            }
            return
        row = rows.get(key)
        if row is None:  # an event for a compilation this ledger never saw submitted
            return
        if event.type == "CompilationPlanned":
            if row["status"] == "pending":
                row["status"] = "running"
        elif event.type == "BaselineMeasured":
            row["baseline_tokens_per_s"] = float(d["tokens_per_s"])
            if row["status"] == "pending":
                row["status"] = "running"
        elif event.type == "BestCandidateImproved":
            row["best_candidate_id"] = d["candidate_id"]
            row["best_tokens_per_s"] = float(d["tokens_per_s"])
            row["speedup"] = float(d["speedup"])
        elif event.type == "CompilationCancelRequested":
            row["reason"] = d.get("reason", "")
        elif event.type == "CompilationEnded":
            row["status"] = _STATUS_BY_END[d["status"]]
            row["reason"] = d.get("reason", "") or row["reason"]
        elif event.type == "ExperimentCompleted":
            row["experiments_done"] += int(is_counted(d["status"]))
            row["failures"] += int(is_failure(d["status"]))
        row["updated_at"] = event.recorded_at
        row["last_position"] = event.position
