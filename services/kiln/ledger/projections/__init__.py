"""The ledger's projections and their registry."""

from __future__ import annotations

from kiln.ledger import tables
from kiln.ledger.projections.base import Projection
from kiln.ledger.projections.best_candidates import BestCandidatesProjection
from kiln.ledger.projections.compilations import CompilationsProjection
from kiln.ledger.projections.experiments import ExperimentsProjection


def all_projections() -> list[Projection]:
    """Every projection, bound to its live table."""
    return [
        CompilationsProjection(tables.proj_compilations),
        ExperimentsProjection(tables.proj_experiments),
        BestCandidatesProjection(tables.proj_best_candidates),
    ]


__all__ = ["Projection", "all_projections"]
