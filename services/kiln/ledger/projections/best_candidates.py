"""Projection: the fastest correct candidate ever found per workload key.

A full-tier best (a candidate confirmed on all layers) replaces a fast-tier one whatever their
tokens/s (a few layers run faster than all of them, so the two are not comparable); within one
tier, only a strictly higher tokens/s replaces the row. Fast-tier rows come from compilations
recorded before winners were confirmed on the full tier.
"""

from __future__ import annotations

from kiln.domain import streams
from kiln.ledger.model import StoredEvent
from kiln.ledger.projections.base import Projection, Rows

_TIER_RANK = {"fast": 0, "full": 1}


def _replaces(current: dict, tier: str, tokens_per_s: float) -> bool:
    new_rank, old_rank = _TIER_RANK.get(tier, 0), _TIER_RANK.get(current["tier"], 0)
    if new_rank != old_rank:
        return new_rank > old_rank
    return tokens_per_s > float(current["tokens_per_s"])


class BestCandidatesProjection(Projection):
    """``proj_best_candidates``: replaced by a full-tier best over a fast-tier one, else only by
    a strictly higher tokens/s on the same tier, so the answer across many compilations of one
    workload is the best any of them found."""

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
        if current is not None and not _replaces(current, d["tier"], float(d["tokens_per_s"])):
            return
        rows[key] = {
            "workload_key": key,
            "candidate_id": d["candidate_id"],
            "compilation_id": event.stream_id.removeprefix(streams.COMPILATION_PREFIX),
            "experiment_id": d["experiment_id"],
            "tokens_per_s": float(d["tokens_per_s"]),
            "speedup": float(d["speedup"]),
            "tier": d["tier"],
            "found_at": event.recorded_at,
            "last_position": event.position,
        }
