"""The events the agent runner appends, built with their stream ids and event ids.

Events the runner may have to append again after a crash (everything but the submission and
cancel requests) get a *deterministic* event id (UUIDv5 of the compilation or experiment id and
the event's role), so re-appending one that was already committed is an idempotent no-op in the
ledger instead of a duplicate. Every event carries the compilation id as its correlation id.
Stream names come from :mod:`kiln.domain.streams` (re-exported here).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from kiln.common.errors import InvalidArgument
from kiln.domain import streams
from kiln.domain.candidate import Candidate
from kiln.events.types import (
    BaselineCompared,
    BaselineMeasured,
    BestCandidateImproved,
    Budget,
    CompilationCancelRequested,
    CompilationEnded,
    CompilationPlanned,
    CompilationSubmitted,
    EndStatus,
    ExperimentCompleted,
    ExperimentRequested,
    Incumbent,
    IncumbentCompared,
    MeasurementReused,
    Outcome,
    Seed,
    Tier,
    TierAgreement,
    TierPoint,
    WarmStartRequest,
)
from kiln.ledger.model import NewEvent

# stream names, re-exported from kiln.domain.streams (the runner's modules name them through here)
COMPILATION_PREFIX = streams.COMPILATION_PREFIX
EXPERIMENT_PREFIX = streams.EXPERIMENT_PREFIX
compilation_stream = streams.compilation_stream
experiment_stream = streams.experiment_stream
stream_suffix = streams.stream_suffix

_NAMESPACE = uuid.UUID("6b1f4a52-3c1e-4a8e-9c57-1a2b8e0d7f11")


def check_compilation_id(value: str) -> str:
    """``value`` if it can name a compilation (:func:`kiln.domain.streams.check_id`).

    Raises:
        InvalidArgument: not 1-128 characters of ``[A-Za-z0-9_-]`` starting with a letter,
            digit or ``_``.
    """
    try:
        return streams.check_id(value, "compilation_id")
    except streams.InvalidId as exc:
        raise InvalidArgument(str(exc)) from None


def new_compilation_id() -> str:
    """A fresh compilation id (32 hex digits)."""
    return uuid.uuid4().hex


def new_experiment_id() -> str:
    """A fresh experiment id (32 hex digits)."""
    return uuid.uuid4().hex


def _event_id(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, ":".join(parts)))


def _event(schema: Any, event_id: str, correlation: str) -> NewEvent:
    return NewEvent(
        type=schema.event_type,
        data=schema.model_dump(mode="json"),
        event_id=event_id,
        correlation_id=correlation,
    )


def submitted(
    compilation_id: str,
    *,
    workload_key: str,
    model_name: str,
    hardware: str,
    workload: dict[str, Any],
    wall_seconds: float,
    max_experiments: int,
    agents: list[str],
    baselines: list[str] | None = None,
    warm_start: WarmStartRequest | None = None,
    seeds: list[Seed] | None = None,
    incumbent: Incumbent | None = None,
) -> NewEvent:
    """``CompilationSubmitted`` (a random event id: a second submission is a conflict) with the
    resolved warm start and incumbent (:mod:`kiln.agent_runner.warm_start`)."""
    payload = CompilationSubmitted(
        workload_key=workload_key,
        model_name=model_name,
        hardware=hardware,
        workload=workload,
        budget=Budget(wall_seconds=wall_seconds, max_experiments=max_experiments),
        agents=agents,
        baselines=list(baselines or []),
        warm_start=warm_start,
        seeds=list(seeds or []),
        incumbent=incumbent,
    )
    return _event(payload, str(uuid.uuid4()), compilation_id)


def planned(compilation_id: str, plan: dict[str, Any]) -> NewEvent:
    """``CompilationPlanned``."""
    return _event(
        CompilationPlanned(plan=plan), _event_id(compilation_id, "planned"), compilation_id
    )


def baseline_measured(
    compilation_id: str,
    experiment_id: str,
    candidate_id: str,
    tokens_per_s: float,
    median_ms: float,
) -> NewEvent:
    """``BaselineMeasured``."""
    payload = BaselineMeasured(
        experiment_id=experiment_id,
        candidate_id=candidate_id,
        tokens_per_s=tokens_per_s,
        median_ms=median_ms,
    )
    return _event(payload, _event_id(compilation_id, "baseline"), compilation_id)


def best_improved(
    compilation_id: str,
    *,
    workload_key: str,
    experiment_id: str,
    candidate_id: str,
    tokens_per_s: float,
    median_ms: float,
    speedup: float,
    tier: Tier,
    reference_experiment_id: str = "",
    reference_tokens_per_s: float = 0.0,
) -> NewEvent:
    """``BestCandidateImproved`` (one per experiment at most); ``reference_*``: the full-tier
    reference measurement ``speedup`` is over."""
    payload = BestCandidateImproved(
        workload_key=workload_key,
        experiment_id=experiment_id,
        candidate_id=candidate_id,
        tokens_per_s=tokens_per_s,
        median_ms=median_ms,
        speedup=speedup,
        tier=tier,
        reference_experiment_id=reference_experiment_id,
        reference_tokens_per_s=reference_tokens_per_s,
    )
    return _event(payload, _event_id(compilation_id, "best", experiment_id), compilation_id)


def tier_agreement(
    compilation_id: str, n: int, rho: float | None, points: list[TierPoint]
) -> NewEvent:
    """``TierAgreement`` (one per compilation)."""
    payload = TierAgreement(n=n, rho=rho, points=points)
    return _event(payload, _event_id(compilation_id, "tier-agreement"), compilation_id)


def cancel_requested(compilation_id: str, reason: str) -> NewEvent:
    """``CompilationCancelRequested``."""
    payload = CompilationCancelRequested(reason=reason)
    return _event(payload, str(uuid.uuid4()), compilation_id)


def ended(compilation_id: str, status: EndStatus, reason: str, outcome: Outcome = "") -> NewEvent:
    """``CompilationEnded`` (one per compilation)."""
    payload = CompilationEnded(status=status, reason=reason, outcome=outcome)
    return _event(payload, _event_id(compilation_id, "ended"), compilation_id)


def experiment_requested(
    compilation_id: str,
    experiment_id: str,
    candidate: Candidate,
    tier: Tier,
    agent: str,
    profile: bool = False,
    baseline: str = "",
) -> NewEvent:
    """``ExperimentRequested`` (appended with expected version: no stream); ``profile`` asks
    the engine for the per-op profile."""
    payload = ExperimentRequested(
        compilation_id=compilation_id,
        candidate_id=candidate.id,
        candidate=candidate.canonical(),
        tier=tier,
        agent=agent,
        profile=profile,
        baseline=baseline,
    )
    return _event(payload, _event_id(experiment_id, "requested"), compilation_id)


def experiment_unanswered(
    compilation_id: str,
    experiment_id: str,
    candidate_id: str,
    tier: Tier,
    error: str,
    status: Literal["timed_out", "cancelled"] = "timed_out",
) -> NewEvent:
    """The runner's own ``ExperimentCompleted`` for an experiment no engine answered:
    ``timed_out`` past its deadline, ``cancelled`` when the compilation ended first. Appended
    with expected version 1, so an engine's result wins."""
    payload = ExperimentCompleted(
        compilation_id=compilation_id,
        candidate_id=candidate_id,
        status=status,
        correct=False,
        max_abs_error=0.0,
        median_ms=0.0,
        p10_ms=0.0,
        p90_ms=0.0,
        tokens_per_s=0.0,
        memory_bytes=0,
        tier=tier,
        engine_id="",
        error=error,
    )
    return _event(payload, _event_id(experiment_id, "unanswered"), compilation_id)


def baseline_compared(compilation_id: str, payload: BaselineCompared) -> NewEvent:
    """``BaselineCompared`` (one per compilation and baseline name)."""
    return _event(payload, _event_id(compilation_id, "compared", payload.name), compilation_id)


def measurement_reused(compilation_id: str, payload: MeasurementReused) -> NewEvent:
    """``MeasurementReused`` (one per compilation and candidate on a tier)."""
    event_id = _event_id(compilation_id, "reused", payload.tier, payload.candidate_id)
    return _event(payload, event_id, compilation_id)


def incumbent_compared(compilation_id: str, payload: IncumbentCompared) -> NewEvent:
    """``IncumbentCompared`` (one per compilation)."""
    return _event(payload, _event_id(compilation_id, "incumbent"), compilation_id)
