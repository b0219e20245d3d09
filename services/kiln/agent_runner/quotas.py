"""Per-team quotas of the agent runner, from ``KILN_QUOTA_*`` (why and how they are enforced:
docs/design/security.md, "Quotas and fairness").

A team's limits are the defaults below, replaced field by field by its entry in
``KILN_QUOTA_TEAMS`` (JSON, e.g. ``{"vision": {"max_running": 8, "device_seconds": 7200}}``).
0 means no limit throughout.

- ``max_running``: compilations of the team running at once; more wait as ``pending`` in
  submission order (:mod:`kiln.agent_runner.admission`).
- ``max_pending``: compilations waiting; a Submit beyond is RESOURCE_EXHAUSTED.
- ``device_seconds`` per ``period_s``: engine time of the team's experiments
  (``ExperimentCompleted.device_ms``) over the last ``period_s`` seconds, from the ledger
  (:mod:`kiln.agent_runner.team_usage`); once reached, no compilation of the team starts and the
  running ones stop searching (their confirmations still run).
- ``max_in_flight``: search-tier work items one compilation has queued or running;
  ``max_in_flight_team``: the same over all of the team's compilations.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.common.identity import TEAM_RULE

MAX_PERIOD_S = 31 * 86400.0
"""The longest quota period: 31 days."""


class TeamLimits(BaseModel):
    """One team's limits (0 = none); see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running: int = Field(default=4, ge=0, le=10_000)
    max_pending: int = Field(default=100, ge=0, le=100_000)
    device_seconds: float = Field(default=0.0, ge=0, le=1e12, allow_inf_nan=False)
    max_in_flight: int = Field(default=4, ge=0, le=10_000)
    max_in_flight_team: int = Field(default=8, ge=0, le=100_000)


class TeamOverride(BaseModel):
    """The fields of :class:`TeamLimits` a team's ``KILN_QUOTA_TEAMS`` entry replaces."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running: int | None = Field(default=None, ge=0, le=10_000)
    max_pending: int | None = Field(default=None, ge=0, le=100_000)
    device_seconds: float | None = Field(default=None, ge=0, le=1e12, allow_inf_nan=False)
    max_in_flight: int | None = Field(default=None, ge=0, le=10_000)
    max_in_flight_team: int | None = Field(default=None, ge=0, le=100_000)


class QuotaSettings(BaseSettings):
    """The quota policy; each field maps to ``KILN_QUOTA_<FIELD>`` in upper case.

    Raises:
        pydantic.ValidationError: a negative or non-finite limit, a period outside
            (0, 31 days], an unknown field or a malformed team name in ``teams``.
    """

    model_config = SettingsConfigDict(env_prefix="KILN_QUOTA_", extra="ignore", frozen=True)

    max_running: int = Field(
        default=4, ge=0, le=10_000, description="Running compilations per team; 0 = no limit."
    )
    max_pending: int = Field(
        default=100,
        ge=0,
        le=100_000,
        description="Compilations per team waiting to run; a Submit beyond is "
        "RESOURCE_EXHAUSTED; 0 = no limit.",
    )
    device_seconds: float = Field(
        default=0.0,
        ge=0,
        le=1e12,
        allow_inf_nan=False,
        description="Engine seconds per team per period; 0 = no limit.",
    )
    period_s: float = Field(
        default=86400.0,
        gt=0,
        le=MAX_PERIOD_S,
        allow_inf_nan=False,
        description="The rolling window of device_seconds, seconds.",
    )
    max_in_flight: int = Field(
        default=4,
        ge=0,
        le=10_000,
        description="Search-tier work items one compilation has queued or running; 0 = no limit.",
    )
    max_in_flight_team: int = Field(
        default=8,
        ge=0,
        le=100_000,
        description="Search-tier work items of all of a team's compilations; 0 = no limit.",
    )
    teams: dict[str, TeamOverride] = Field(
        default_factory=dict,
        description='Per-team overrides as JSON, e.g. {"vision": {"max_running": 8}}.',
    )

    @field_validator("teams")
    @classmethod
    def _check_teams(cls, value: dict[str, TeamOverride]) -> dict[str, TeamOverride]:
        bad = [team for team in value if not re.match(TEAM_RULE, team)]
        if bad:
            raise ValueError(f"team names must match {TEAM_RULE}, got {bad[0][:80]!r}")
        return value

    def limits(self, team: str) -> TeamLimits:
        """``team``'s limits: the defaults with its override applied."""
        base: dict[str, Any] = {
            "max_running": self.max_running,
            "max_pending": self.max_pending,
            "device_seconds": self.device_seconds,
            "max_in_flight": self.max_in_flight,
            "max_in_flight_team": self.max_in_flight_team,
        }
        override = self.teams.get(team)
        if override is not None:
            base.update(override.model_dump(exclude_none=True))
        return TeamLimits(**base)
