"""The event types of a deployment, version 1, on streams ``deployment-<id>`` (id: the first 32
hex digits of sha256("<team>/<name>"), :mod:`kiln.domain.deployment`). The agent runner appends
all of them (its deployment controller and the Deployments servicer). Shapes are
``kiln.v1.TrafficShape`` messages as JSON; times in the traffic's arrival seconds unless named
otherwise; throughput in tokens/s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.events.schema import EventSchema

RecompilationReason = Literal["initial", "drift", "predicted_drop"]


class DeploymentCreated(EventSchema):
    """A team created a deployment: what to compile, on what, and how to watch its traffic."""

    event_type = "DeploymentCreated"
    category = "deployment"

    team: str = Field(min_length=1)
    name: str = Field(min_length=1)
    workload: dict[str, Any] = Field(
        description="The kiln.v1.Workload of the first compilation as JSON (initial shape)."
    )
    policy: dict[str, Any] = Field(description="The kiln.v1.DeploymentPolicy as JSON (resolved).")
    drift_policy: dict[str, Any] = Field(
        description="kiln.workloads.traffic.drift.DriftPolicy.to_dict() of the policy."
    )


class RecompilationStarted(EventSchema):
    """A compilation was started for the deployment (recorded before it is submitted, with its
    id fixed, so a restart submits it at most once)."""

    event_type = "RecompilationStarted"
    category = "deployment"

    compilation_id: str = Field(min_length=1)
    reason: RecompilationReason
    window_index: int = Field(default=-1, ge=-1)
    window_end_s: float = 0.0
    shape: dict[str, Any] = Field(description="The kiln.v1.TrafficShape compiled for, as JSON.")
    warm_start_compilation_ids: list[str] = Field(default_factory=list)
    nearby: bool = False
    incumbent_candidate_id: str = ""


class TrafficWindowObserved(EventSchema):
    """One closed traffic window: its shape and its drift from the proven shape, and what the
    detector decided. ``resume_sequence``: the traffic stream sequence to re-read from after a
    restart (the first record of a window still open when this one closed)."""

    event_type = "TrafficWindowObserved"
    category = "deployment"

    index: int = Field(ge=0)
    start_s: float
    end_s: float
    origin_s: float
    requests: int = Field(ge=0)
    sparse: bool
    shape: dict[str, Any] = Field(default_factory=dict)
    drift: dict[str, Any] = Field(
        default_factory=dict, description="DriftMeasure.to_dict() (empty for an empty window)."
    )
    drifted: bool = False
    triggered: bool = False
    consecutive: int = Field(default=0, ge=0)
    reason: str = ""
    predicted_drop: float | None = None
    resume_sequence: int = Field(default=1, ge=1)


class DriftDetected(EventSchema):
    """The detector fired on a window: the deciding numbers."""

    event_type = "DriftDetected"
    category = "deployment"

    window_index: int = Field(ge=0)
    window_end_s: float
    score: float = Field(ge=0)
    dominant: str
    dimensions: dict[str, float] = Field(default_factory=dict)
    normalized: dict[str, float] = Field(default_factory=dict)
    consecutive: int = Field(ge=0)
    reason: str
    predicted_drop: float | None = None
    proven_shape: dict[str, Any] = Field(default_factory=dict)
    window_shape: dict[str, Any] = Field(default_factory=dict)


class Comparison(EventSchema):
    """The incumbent vs challenger numbers of a compilation (its IncumbentComparison), or of
    the first compilation's winner alone (no incumbent)."""

    incumbent_candidate_id: str = ""
    challenger_candidate_id: str = ""
    incumbent_tokens_per_s: list[float] = Field(default_factory=list)
    challenger_tokens_per_s: list[float] = Field(default_factory=list)
    incumbent_median: float = Field(default=0.0, ge=0)
    challenger_median: float = Field(default=0.0, ge=0)
    gain: float = 0.0
    noise: float = Field(default=0.0, ge=0)
    challenger_better: bool = False
    reason: str = ""
    experiment_ids: list[str] = Field(default_factory=list)


class CandidatePromoted(EventSchema):
    """A candidate became the active one: the first compilation's winner (``initial``) or a
    challenger that beat the active candidate beyond noise and the margin (``better``).
    ``shape`` becomes the proven shape."""

    event_type = "CandidatePromoted"
    category = "deployment"

    compilation_id: str = Field(min_length=1)
    candidate_id: str = Field(min_length=1)
    previous_candidate_id: str = ""
    reason: Literal["initial", "better"]
    tokens_per_s: float = Field(default=0.0, ge=0)
    speedup: float = Field(default=0.0, ge=0)
    shape: dict[str, Any] = Field(default_factory=dict)
    comparison: Comparison = Field(default_factory=lambda: Comparison())
    rebased_at_s: float | None = Field(
        default=None, description="Arrival time the drift detector was rebased at (None: initial)."
    )


class PromotionDeclined(EventSchema):
    """A recompilation ended without replacing the active candidate (not better beyond noise
    and margin, no correct winner, failed, or not comparable); ``shape`` becomes the proven
    shape all the same (the active candidate was measured there), unless ``compilation_failed``."""

    event_type = "PromotionDeclined"
    category = "deployment"

    compilation_id: str = Field(min_length=1)
    challenger_candidate_id: str = ""
    incumbent_candidate_id: str = ""
    reason: str = Field(min_length=1)
    compilation_failed: bool = False
    shape: dict[str, Any] = Field(default_factory=dict)
    comparison: Comparison = Field(default_factory=lambda: Comparison())
    rebased_at_s: float | None = Field(
        default=None,
        description="Arrival time the drift detector was rebased at (None: not rebased).",
    )


class CandidateRolledBack(EventSchema):
    """The previous active candidate became active again."""

    event_type = "CandidateRolledBack"
    category = "deployment"

    from_candidate_id: str = Field(min_length=1)
    to_candidate_id: str = Field(min_length=1)
    to_compilation_id: str = Field(min_length=1)
    reason: str = ""
    by: str = Field(
        default="", description="The principal that asked (spiffe URI), empty without TLS."
    )


DEPLOYMENT_TYPES = (
    DeploymentCreated.event_type,
    RecompilationStarted.event_type,
    TrafficWindowObserved.event_type,
    DriftDetected.event_type,
    CandidatePromoted.event_type,
    PromotionDeclined.event_type,
    CandidateRolledBack.event_type,
)
"""Event types of the ``deployment-<id>`` stream."""
