"""Tunables of the agent runner that ``KilnSettings`` does not carry (defaults suit a real pool;
tests pass short times).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


@dataclass(frozen=True)
class RunnerConfig:
    """How the agent runner drives compilations (seconds throughout).

    Attributes:
        experiment_deadline_s: ``ExperimentWork.deadline_s`` of a reference or candidate
            experiment (at most 3600).
        baseline_deadline_s: the same of a baseline's experiment (a baseline may compile its
            model, e.g. ``hf_compile``: Inductor on a 48-layer MoE takes minutes).
        experiment_margin_s: waited beyond the deadline before the runner records ``timed_out``.
        search_share: the largest share of the wall-clock budget one search-tier candidate may
            take (:meth:`search_deadline_s`), at least ``search_min_deadline_s`` but never more
            than half the budget.
        plan_timeout_s, plan_attempts: one cost-model ``Plan`` call's deadline; tries while it is
            UNAVAILABLE or times out.
        plan_outage_s: how long planning keeps trying a cost model that is UNAVAILABLE (one
            restarting under ``kiln supervise`` is back in seconds), past ``plan_attempts``.
        cancel_wait_s: how long ``Cancel`` waits for a local runner to record the end.
        pools_timeout_s: how long Submit waits for the engine pools' registry
            (:mod:`kiln.agent_runner.pools`).
        resume_retry_s: pause between resume attempts while the ledger is unreachable.
        confirm_grace_s: how long past its wall-clock budget a compilation waits for a
            confirmation under way or due (its agents stopped): one that waited for a device is
            still run, within this bound.
        warm_measure: seeds of a warm start measured before the agents propose (the rest are
            the optuna study's prior trials: :mod:`kiln.agent_runner.seeding`).
        reuse_max_age_s: how old an earlier measurement may be to answer a search-tier
            experiment (:mod:`kiln.agent_runner.reuse`); 0 turns reuse off.
        incumbent_runs, incumbent_margin: full-tier runs of each side of the incumbent
            comparison and the least gain that counts beyond noise
            (:mod:`kiln.agent_runner.incumbent`).
    """

    experiment_deadline_s: float = 300.0
    baseline_deadline_s: float = 900.0
    experiment_margin_s: float = 60.0
    search_share: float = 0.25
    search_min_deadline_s: float = 60.0
    plan_timeout_s: float = 10.0
    plan_attempts: int = 3
    plan_outage_s: float = 60.0
    cancel_wait_s: float = 10.0
    pools_timeout_s: float = 5.0
    resume_retry_s: float = 2.0
    confirm_grace_s: float = 300.0
    warm_measure: int = 4
    reuse_max_age_s: float = 24 * 3600.0
    incumbent_runs: int = 3
    incumbent_margin: float = 0.02

    def search_deadline_s(self, wall_seconds: float) -> float:
        """:attr:`search_share` of ``wall_seconds`` within [:attr:`search_min_deadline_s`,
        :attr:`experiment_deadline_s`], and at most half of ``wall_seconds`` (so that one slow
        candidate, e.g. a long torch.compile, leaves a short budget time to confirm a leader).
        """
        share = max(self.search_min_deadline_s, self.search_share * wall_seconds)
        return min(self.experiment_deadline_s, share, 0.5 * wall_seconds)

    def deadline_cap_s(self, baseline: str = "") -> float:
        """The longest ``ExperimentWork.deadline_s`` of an experiment: a baseline's (``baseline``
        non-empty) or any other's."""
        return self.baseline_deadline_s if baseline else self.experiment_deadline_s

    def timeout_s(self, baseline: str = "") -> float:
        """Seconds from publishing work to recording it timed out: its deadline cap + margin."""
        return self.deadline_cap_s(baseline) + self.experiment_margin_s


class RunnerSettings(BaseSettings):
    """The experiment deadlines an operator may set, from ``KILN_RUNNER_*``; the rest of
    :class:`RunnerConfig` keeps its defaults.

    Raises:
        pydantic.ValidationError: a deadline outside (0, 3600] seconds.
    """

    model_config = SettingsConfigDict(env_prefix="KILN_RUNNER_", extra="ignore", frozen=True)

    experiment_deadline_s: float = Field(
        default=RunnerConfig.experiment_deadline_s,
        gt=0,
        le=3600,
        description="Deadline of a reference or candidate experiment on an engine, seconds.",
    )
    baseline_deadline_s: float = Field(
        default=RunnerConfig.baseline_deadline_s,
        gt=0,
        le=3600,
        description="Deadline of a baseline's experiment (hf_compile compiles), seconds.",
    )

    def config(self) -> RunnerConfig:
        """A :class:`RunnerConfig` with these deadlines."""
        return RunnerConfig(
            experiment_deadline_s=self.experiment_deadline_s,
            baseline_deadline_s=self.baseline_deadline_s,
        )


class LLMSettings(BaseSettings):
    """The code-writing agent's OpenAI-compatible endpoint, from ``KILN_LLM_*``; the ``llm``
    agent is refused while ``KILN_LLM_URL`` is unset.
    """

    model_config = SettingsConfigDict(env_prefix="KILN_LLM_", extra="ignore")

    url: str | None = Field(
        default=None,
        description="Base URL, e.g. http://127.0.0.1:8000/v1; unset = the llm agent is off.",
    )
    model: str = Field(default="gpt-4o-mini", description="The model name sent in each request.")
    api_key: SecretStr | None = Field(default=None, description="Bearer token; unset = no header.")
    timeout_s: float = Field(
        default=120.0, gt=0, description="Deadline of one HTTP request, seconds."
    )
    max_tokens: int = Field(default=4096, gt=0, description="Completion length limit, tokens.")
    temperature: float = Field(default=0.2, ge=0, le=2, description="Sampling temperature.")
    attempts: int = Field(
        default=4,
        ge=1,
        le=10,
        description="Tries of one request on 429, 5xx or a connection error.",
    )
    backoff_s: float = Field(
        default=1.0, ge=0, description="First pause between tries, seconds (doubles, at most 30 s)."
    )
    max_bad_replies: int = Field(
        default=3, ge=1, description="Unusable replies in a row before the agent stops."
    )
    history_chars: int = Field(
        default=6000, ge=200, description="Budget of the results history in the prompt, characters."
    )


class OptunaSettings(BaseSettings):
    """Where the ``optuna`` agent keeps its studies, from ``KILN_OPTUNA_*``: ``STORAGE`` a
    SQLAlchemy URL or ``memory`` (unset: memory), ``DB_SCHEMA`` its Postgres schema.
    """

    model_config = SettingsConfigDict(env_prefix="KILN_OPTUNA_", extra="ignore")

    storage: str | None = Field(
        default=None, description="SQLAlchemy URL or 'memory'; unset = in memory."
    )
    db_schema: str = Field(
        default="optuna",
        pattern=r"^[a-z_][a-z0-9_]{0,62}$",
        description="Postgres schema of the studies (created if missing).",
    )
