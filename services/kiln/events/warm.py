"""Event payloads of warm-started compilations (docs/design/warm_start.md): what a submission
resolved its warm start and incumbent to, measurements answered from an earlier experiment, and
the side-by-side comparison with the incumbent. Registered by being defined (imported by
:mod:`kiln.events.types`); category ``compilation``, appended by the agent runner.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.events.schema import EventSchema

SeedSource = Literal["winner", "measured", "nearby"]
"""Why a candidate seeds a compilation: the best of a compilation named in the warm start
(``winner``), another correct measurement of one (``measured``), or the best of a nearby
workload of the team (``nearby``)."""


class WarmStartRequest(EventSchema):
    """The warm start as submitted (``SubmitRequest.warm_start``)."""

    compilation_ids: list[str] = Field(default_factory=list)
    nearby: bool = False


class Seed(EventSchema):
    """One candidate a warm-started compilation measures before its agents propose: its full
    content, where it came from, and what it measured there (``tokens_per_s`` on ``tier`` at the
    source's operating point: ranking information only, never compared with this compilation's
    numbers)."""

    candidate_id: str = Field(min_length=1)
    candidate: dict[str, Any] = Field(description="The kiln.v1.Candidate message as JSON.")
    source: SeedSource
    compilation_id: str = Field(min_length=1)
    experiment_id: str = Field(min_length=1)
    workload_key: str = ""
    tier: Literal["fast", "full"] = "fast"
    tokens_per_s: float = Field(default=0.0, ge=0)
    speedup: float = Field(
        default=0.0,
        ge=0,
        description="Over the source's own reference (fast-tier baseline for ``measured``, the "
        "adjacent full-tier reference for a winner); 0 when unknown.",
    )
    lost_on_full_tier: bool = Field(
        default=False,
        description="The source measured it on the full tier and it did not become the "
        "source's best (a ``measured`` seed its own compilation confirmed and found wanting).",
    )


class Incumbent(EventSchema):
    """The incumbent candidate resolved at submission: its content and one experiment of the
    team's that measured it (``compilation_id``, ``experiment_id``)."""

    candidate_id: str = Field(min_length=1)
    candidate: dict[str, Any] = Field(description="The kiln.v1.Candidate message as JSON.")
    compilation_id: str = ""
    experiment_id: str = ""


class MeasurementReused(EventSchema):
    """A search-tier experiment answered from an earlier, still valid measurement of the same
    candidate at the same operating point (docs/design/warm_start.md, "Reuse"): no engine ran,
    no device time, outside the experiment budget. ``result`` is the original
    ``ExperimentCompleted`` payload, unchanged; ``experiment_id`` its experiment."""

    event_type = "MeasurementReused"
    category = "compilation"

    experiment_id: str = Field(min_length=1)
    source_compilation_id: str = Field(min_length=1)
    candidate_id: str = Field(min_length=1)
    candidate: dict[str, Any] = Field(description="The kiln.v1.Candidate message as JSON.")
    agent: str = Field(min_length=1, description="The agent whose proposal it answered.")
    tier: Literal["fast", "full"] = "fast"
    reuse_key: str = Field(min_length=1, description="The operating-point key both share.")
    result: dict[str, Any] = Field(description="The original ExperimentCompleted payload.")
    source_completed_at: str = Field(
        default="", description="When the original completed (ISO 8601, UTC)."
    )


class IncumbentCompared(EventSchema):
    """The incumbent and the compilation's winner measured side by side on the full tier, runs
    interleaved (``experiment_ids`` in run order, incumbent first), or why no comparison was
    made (``compared`` false). Decision rule: docs/design/warm_start.md ("Incumbent")."""

    event_type = "IncumbentCompared"
    category = "compilation"

    compared: bool
    incumbent_candidate_id: str = Field(min_length=1)
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
    runs: int = Field(default=0, ge=0, description="Runs asked for each side.")
