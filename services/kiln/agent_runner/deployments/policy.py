"""A deployment's policy: checking a submitted ``kiln.v1.DeploymentPolicy`` and filling in the
defaults, and the window spec and drift policy it stands for.

Zero fields take the defaults: windows of :class:`WindowSpec` (600 s, step 300 s, 50 requests),
drift thresholds of :class:`DriftPolicy` (Contract 1's defaults, chosen in
:mod:`kiln.workloads.traffic.drift`), a recompilation budget of :data:`DEFAULT_BUDGET_S`, no
limit on recompilations, promotion margin 0 (better beyond the comparison's noise suffices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict, ParseDict

from kiln.agent_runner.agents import validate_agents
from kiln.agent_runner.budget import validate_budget
from kiln.common.errors import InvalidArgument
from kiln.v1 import common_pb2, deployments_pb2
from kiln.workloads.traffic.drift import DriftPolicy
from kiln.workloads.traffic.windows import WindowSpec

DEFAULT_BUDGET_S = 300.0
"""Wall-clock seconds of each compilation when the policy gives none."""
MAX_MARGIN = 10.0


@dataclass(frozen=True)
class ResolvedPolicy:
    """A checked policy: the message with every default filled in, its windows and drift."""

    message: deployments_pb2.DeploymentPolicy
    windows: WindowSpec
    drift: DriftPolicy

    def to_json(self) -> dict[str, Any]:
        """The message as JSON (what ``DeploymentCreated.policy`` records)."""
        return MessageToDict(self.message, preserving_proto_field_name=True)


def _finite(name: str, value: float, *, low: float = 0.0, high: float = math.inf) -> float:
    if not math.isfinite(value) or value < low or value > high:
        raise InvalidArgument(f"policy.{name} must be a number in [{low:g}, {high:g}], got {value}")
    return value


def resolve_policy(policy: deployments_pb2.DeploymentPolicy | None) -> ResolvedPolicy:
    """``policy`` checked, with defaults for its zero fields.

    Raises:
        InvalidArgument: a negative or non-finite number, step above length, release not below
            threshold, a bad budget or agent name (the message names the field).
    """
    given = policy or deployments_pb2.DeploymentPolicy()
    for name in ("window_s", "step_s", "threshold", "release", "cooldown_s", "predicted_drop"):
        _finite(name, getattr(given, name))
    _finite("promotion_margin", given.promotion_margin, high=MAX_MARGIN)
    defaults = WindowSpec()
    try:
        windows = WindowSpec(
            length_s=given.window_s or defaults.length_s,
            step_s=given.step_s or min(given.window_s or defaults.step_s, defaults.step_s),
            min_requests=given.min_requests or defaults.min_requests,
        )
    except ValueError as exc:
        raise InvalidArgument(f"policy windows: {exc}") from None
    drift_args: dict[str, Any] = {
        k: getattr(given, k)
        for k in ("threshold", "release", "consecutive", "cooldown_s", "predicted_drop")
        if getattr(given, k)
    }
    try:
        drift = DriftPolicy(**drift_args)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"policy drift thresholds: {exc}") from None
    budget = common_pb2.Budget()
    budget.CopyFrom(given.budget)
    if not budget.wall_seconds:
        budget.wall_seconds = DEFAULT_BUDGET_S
    validate_budget(budget)
    agents = validate_agents(list(given.agents))
    d = drift.to_dict()
    message = deployments_pb2.DeploymentPolicy(
        window_s=windows.length_s,
        step_s=windows.step_s,
        min_requests=windows.min_requests,
        threshold=float(d["threshold"]),
        release=float(d["release"]),
        consecutive=int(d["consecutive"]),
        cooldown_s=float(d["cooldown_s"]),
        predicted_drop=float(d["predicted_drop"]),
        budget=budget,
        max_recompilations=given.max_recompilations,
        promotion_margin=given.promotion_margin,
        agents=agents,
        nearby=given.nearby,
    )
    return ResolvedPolicy(message, windows, drift)


def policy_from_json(policy: dict[str, Any], drift: dict[str, Any]) -> ResolvedPolicy:
    """The policy a ``DeploymentCreated`` recorded (its resolved message and drift dict)."""
    message = ParseDict(policy, deployments_pb2.DeploymentPolicy(), ignore_unknown_fields=True)
    windows = WindowSpec(
        length_s=message.window_s, step_s=message.step_s, min_requests=message.min_requests
    )
    return ResolvedPolicy(message, windows, DriftPolicy.from_dict(drift))
