"""Helpers for the runner-side tests: a compilation state and experiments requested and
completed by hand (no ledger)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.state import Baseline, Best, CompilationState, ExperimentRecord
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.events.types import ExperimentCompleted, Tier
from kiln.v1 import common_pb2

_ids = itertools.count(1)


def new_state(
    baseline: float | None = None, best: float | None = None, submitted_at: datetime | None = None
) -> CompilationState:
    """Compilation ``c1`` of team ``search`` (submitted now unless ``submitted_at``), with a
    baseline / best at those tokens/s."""
    state = CompilationState(
        compilation_id="c1",
        team="search",
        workload=common_pb2.Workload(workload_key="wk-1"),
        wall_seconds=60,
        max_experiments=0,
        agents=[],
        submitted_at=submitted_at or datetime.now(UTC),
        submitted_position=1,
    )
    if baseline is not None:
        state.baseline = Baseline("e0", REFERENCE_CANDIDATE.id, baseline, 10.0)
    if best is not None:
        state.best = Best("e1", "x", best * 100, 5.0, best)
    return state


def done(
    cand: Candidate,
    agent: str,
    tps: float,
    status: str = "ok",
    tier: Tier = "fast",
    spread: float = 0.02,
    op_ms: dict[str, float] | None = None,
    *,
    device_ms: float = 0.0,
    at: datetime | None = None,
) -> tuple[Requested, Completed]:
    """A request and its completion in ``c1`` (one sequence per step, p10/p90 at -/+ ``spread``
    of the median, recorded now unless ``at``); positions grow with every call (ledger
    order)."""
    n = next(_ids)
    req = Requested(f"e{n}", "c1", "search", cand, agent, tier, 10 * n)
    median = 1000.0 / tps if tps > 0 else 0.0
    result = ExperimentCompleted(
        compilation_id="c1",
        candidate_id=cand.id,
        status=status,  # type: ignore[arg-type]
        correct=status == "ok",
        median_ms=median,
        p10_ms=median * (1 - spread),
        p90_ms=median * (1 + spread),
        tokens_per_s=tps,
        engine_id="e",
        tier=tier,
        op_ms=op_ms or {},
        device_ms=device_ms,
    )
    return req, Completed(f"e{n}", result, 10 * n + 1, at or datetime.now(UTC))


def add(state: CompilationState, *args: Any, **kwargs: Any) -> tuple[Requested, Completed]:
    """:func:`done` (same arguments), recorded in ``state``'s experiments."""
    req, completed = done(*args, **kwargs)
    state.experiments[req.experiment_id] = ExperimentRecord(req, completed)
    return req, completed
