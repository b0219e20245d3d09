"""The event types kiln records, version 1, on streams ``compilation-<id>`` and
``experiment-<id>``. Payloads do not repeat the envelope (ids, team, time). Units: ms, tokens/s,
bytes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.events.schema import EventSchema
from kiln.events.warm import (  # noqa: F401  (registers MeasurementReused, IncumbentCompared)
    Incumbent,
    IncumbentCompared,
    MeasurementReused,
    Seed,
    WarmStartRequest,
)

Tier = Literal["fast", "full"]
ExperimentStatus = Literal["ok", "incorrect", "crashed", "timed_out", "rejected", "cancelled"]
"""``cancelled``: the compilation ended while the experiment was queued or running; it is
neither counted as done nor as a failure."""


def is_counted(status: str) -> bool:
    """Whether an experiment with ``status`` counts as done (everything but ``cancelled``)."""
    return status != "cancelled"


def is_failure(status: str) -> bool:
    """Whether ``status`` is a failed experiment (incorrect, crashed, timed out, rejected)."""
    return status not in ("ok", "cancelled")


EndStatus = Literal["succeeded", "cancelled", "failed"]
Outcome = Literal["", "confirmed", "none_beat_the_baseline", "unconfirmed", "lost_on_full_tier"]
"""What a compilation's search came to (:mod:`kiln.agent_runner.outcome`); "" for a failed
compilation and in events recorded before the field existed."""


MAX_WALL_SECONDS = 30 * 24 * 3600.0
MAX_EXPERIMENTS = 1_000_000


class Budget(EventSchema):
    """Compilation limits: wall-clock seconds (0 < s <= 30 days) and experiment count
    (0 = unlimited, at most 1,000,000)."""

    wall_seconds: float = Field(gt=0, le=MAX_WALL_SECONDS)
    max_experiments: int = Field(0, ge=0, le=MAX_EXPERIMENTS)


class CompilationSubmitted(EventSchema):
    """A team asked for a compilation of a workload."""

    event_type = "CompilationSubmitted"
    category = "compilation"

    workload_key: str = Field(min_length=1)
    model_name: str = Field(min_length=1)
    hardware: str = Field(min_length=1)
    workload: dict[str, Any] = Field(description="The kiln.v1.Workload message as JSON.")
    budget: Budget
    agents: list[str] = Field(default_factory=list)
    baselines: list[str] = Field(
        default_factory=list,
        description="Baselines of kiln.baselines to measure beside the search "
        "(hf_eager, hf_static, hf_compile, gpt_fast); empty = none.",
    )
    warm_start: WarmStartRequest | None = Field(
        default=None, description="The warm start as submitted (None: a cold start)."
    )
    seeds: list[Seed] = Field(
        default_factory=list,
        description="The warm start resolved at submission: candidates measured first, best "
        "first, each with its source compilation and experiment.",
    )
    incumbent: Incumbent | None = Field(
        default=None,
        description="The incumbent resolved at submission (its full content), measured side "
        "by side with the winner after the search (IncumbentCompared).",
    )


class CompilationPlanned(EventSchema):
    """The cost model chose a parallelism plan."""

    event_type = "CompilationPlanned"
    category = "compilation"

    plan: dict[str, Any] = Field(description="The kiln.v1.ParallelismPlan message as JSON.")


class BaselineMeasured(EventSchema):
    """The reference forward pass was measured; speedups are relative to it."""

    event_type = "BaselineMeasured"
    category = "compilation"

    experiment_id: str
    candidate_id: str
    tokens_per_s: float = Field(ge=0)
    median_ms: float = Field(ge=0)


class BaselineCompared(EventSchema):
    """A baseline measured on the full-tier engine beside the search, for comparison only: never
    a candidate or best. ``correct``: its own check against kiln's reference; ``skipped_reason``
    or ``error`` say why it did not run or failed; ``batch`` (tokens_per_s = batch / median),
    ``context`` and ``weights_bytes`` give its bandwidth limit.
    """

    event_type = "BaselineCompared"
    category = "compilation"

    name: str = Field(min_length=1)
    experiment_id: str
    status: ExperimentStatus
    correct: bool = False
    tokens_per_s: float = Field(0.0, ge=0)
    median_ms: float = Field(0.0, ge=0)
    p10_ms: float = Field(0.0, ge=0)
    p90_ms: float = Field(0.0, ge=0)
    max_abs_error: float = Field(0.0, ge=0)
    skipped_reason: str = ""
    error: str = ""
    tier: Tier = "full"
    batch: int = Field(0, ge=0)
    weights_bytes: int = Field(0, ge=0, le=2**62)
    context: int = Field(
        default=0,
        ge=0,
        description="Tokens in each sequence's KV cache at the operating point (the engine's "
        "context_len); 0 in events written before it was recorded (the table then takes it "
        "from a full-tier ExperimentCompleted, else counts the weights only).",
    )
    prefill_median_ms: float = Field(
        default=0.0,
        ge=0,
        description="Median of the baseline's timed prefills of batch x context prompt tokens, "
        "ms, timed as a candidate's (its ExperimentCompleted.prefill_median_ms); 0 when not "
        "timed (the engine's prefill_repeats was 0) or in events written before it was recorded.",
    )


class BestCandidateImproved(EventSchema):
    """A candidate confirmed on the full tier beat the best, ``speedup`` over the reference
    measured next to it.
    """

    event_type = "BestCandidateImproved"
    category = "compilation"

    workload_key: str
    experiment_id: str
    candidate_id: str
    tokens_per_s: float = Field(ge=0)
    median_ms: float = Field(ge=0)
    speedup: float = Field(ge=0)
    tier: Tier
    reference_experiment_id: str = Field(
        default="",
        description="The full-tier reference experiment ``speedup`` is over (empty in events "
        "written before it was recorded).",
    )
    reference_tokens_per_s: float = Field(
        default=0.0, ge=0, description="That reference's tokens/s (0 when not recorded)."
    )
    elapsed_s: float = Field(
        default=0.0, ge=0, description="Seconds from the submission to the confirming result."
    )
    experiments: int = Field(default=0, ge=0, description="Experiments completed by then.")
    device_s: float = Field(
        default=0.0, ge=0, description="Engine busy seconds spent by then (all agents)."
    )


class TierPoint(EventSchema):
    """One candidate measured correct on both tiers: its fast-tier and full-tier tokens/s (the
    reference's full-tier value is the median of its full-tier measurements)."""

    candidate_id: str
    fast_tokens_per_s: float = Field(ge=0)
    full_tokens_per_s: float = Field(ge=0)


class TierAgreement(EventSchema):
    """Spearman's rho between fast- and full-tier tokens/s over the ``n`` candidates correct on
    both, recorded once before ``CompilationEnded``; null when undefined.
    """

    event_type = "TierAgreement"
    category = "compilation"

    n: int = Field(ge=0)
    rho: float | None = Field(default=None, ge=-1, le=1)
    points: list[TierPoint] = Field(default_factory=list)


class CompilationCancelRequested(EventSchema):
    """Someone asked a running compilation to stop."""

    event_type = "CompilationCancelRequested"
    category = "compilation"

    reason: str = ""


class CompilationEnded(EventSchema):
    """The compilation stopped: budget spent (succeeded), cancelled, or failed."""

    event_type = "CompilationEnded"
    category = "compilation"

    status: EndStatus
    reason: str = ""
    outcome: Outcome = Field(
        default="",
        description="What the search came to: confirmed (a best), none_beat_the_baseline, "
        "unconfirmed (a fast-tier winner never measured correct on the full tier), "
        "lost_on_full_tier; empty for a failed compilation and in older events.",
    )


class ExperimentRequested(EventSchema):
    """An agent asked for a candidate to be measured."""

    event_type = "ExperimentRequested"
    category = "experiment"

    compilation_id: str
    candidate_id: str
    candidate: dict[str, Any] = Field(description="The kiln.v1.Candidate message as JSON.")
    tier: Tier
    agent: str
    profile: bool = Field(
        default=False,
        description="The per-op profile was asked for (ExperimentCompleted.op_ms).",
    )
    baseline: str = Field(
        default="",
        description="A baseline of kiln.baselines measured instead of the candidate (agent "
        "compare:<name>); never a candidate, a reference or a best. Empty for a normal "
        "experiment.",
    )


class ExperimentCompleted(EventSchema):
    """An engine measured (or failed to measure) a candidate."""

    event_type = "ExperimentCompleted"
    category = "experiment"

    compilation_id: str
    candidate_id: str
    status: ExperimentStatus
    correct: bool
    max_abs_error: float = Field(0.0, ge=0)
    median_ms: float = Field(0.0, ge=0)
    p10_ms: float = Field(0.0, ge=0)
    p90_ms: float = Field(0.0, ge=0)
    mean_ms: float = Field(
        default=0.0,
        ge=0,
        description="Mean of the timed decode steps, ms; 0 in events written before it was "
        "recorded. tokens_per_s is batch per decision step, max(median, mean / 1.25) "
        "(kiln.domain.step_time).",
    )
    max_ms: float = Field(
        default=0.0, ge=0, description="Slowest timed decode step, ms; 0 when not recorded."
    )
    tokens_per_s: float = Field(0.0, ge=0)
    memory_bytes: int = Field(0, ge=0, le=2**62)
    engine_id: str = ""
    tier: Tier
    error: str = ""
    weights_bytes: int = Field(default=0, ge=0, le=2**62)
    kv_cache_bytes: int = Field(default=0, ge=0, le=2**62)
    workspace_bytes: int = Field(default=0, ge=0, le=2**62)
    prefill_median_ms: float = Field(default=0.0, ge=0)
    prefill_tokens_per_s: float = Field(default=0.0, ge=0)
    phases_ms: dict[str, float] = Field(default_factory=dict)
    device_ms: float = Field(
        default=0.0,
        ge=0,
        description="Engine busy time of the experiment, ms: from the request's arrival in the "
        "engine to the engine being put back (the phases plus fingerprinting and restore); 0 "
        "when the engine did not report it (old events, the runner's time-outs).",
    )
    environment: dict[str, str] = Field(
        default_factory=dict,
        description="Versions the engine measured with (kiln, torch, triton, cuda, gpu, python).",
    )
    batch_size: int = Field(
        default=0,
        ge=0,
        description="Decode batch measured at (sequences; a CUDA engine may have lowered the "
        "traffic's batch to fit free memory); 0 in events written before it was recorded.",
    )
    context_len: int = Field(
        default=0, ge=0, description="Context measured at (tokens); 0 when not recorded."
    )
    op_ms: dict[str, float] = Field(
        default_factory=dict,
        description="Per-op profile of one extra eager decode step at the traffic shape: op name "
        "-> ms per step, summed over the layers held; empty unless the request asked for it "
        "(kiln.runtime.op_profile).",
    )
    op_profile_shape: dict[str, int] = Field(
        default_factory=dict,
        description="The operating point of op_ms: layers, batch_size, context_len, dtype_bytes.",
    )
    verified_steps: int = Field(
        default=0,
        ge=0,
        description="Timed steps verified against the reference after timing; 0 when none "
        "(or in events written before it was recorded).",
    )
    escape_probability: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="(1 - 0.2)^verified_steps: the chance that a candidate wrong on a fifth of "
        "its timed steps escaped verification (kiln.runtime.timed_verification); 1 when none "
        "was verified or not recorded.",
    )
