"""Projection: the fastest correct candidate ever found per workload key."""

from __future__ import annotations

from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.base import Projection, Rows


class BestCandidatesProjection(Projection):
    """``proj_best_candidates``: replaced only by a strictly higher tokens/s, so the answer
    across many compilations of one workload is the best any of them found."""

    name = "best_candidates"
    key = "workload_key"
    handles = frozenset({"BestCandidateImproved"})

    def key_of(self, event: StoredEvent) -> str | None:
        return str(event.data["workload_key"]) if event.type in self.handles else None

    def apply(self, rows: Rows, event: StoredEvent) -> None:
        key = self.key_of(event)
        if key is None:
            return
        d = event.data
        current = rows.get(key)
        if current is not None and current["tokens_per_s"] >= float(d["tokens_per_s"]):
            return
        rows[key] = {
            "workload_key": key,
            "candidate_id": d["candidate_id"],
            "compilation_id": event.stream_id[len("compilation-") :],
            "experiment_id": d["experiment_id"],
            "tokens_per_s": float(d["tokens_per_s"]),
            "speedup": float(d["speedup"]),
            "tier": d["tier"],
            "found_at": event.recorded_at,
            "last_position": event.position,
        }
