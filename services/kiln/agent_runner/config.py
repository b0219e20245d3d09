"""Tunables of the agent runner that ``KilnSettings`` does not carry (defaults suit a real pool).

Tests pass a :class:`RunnerConfig` with short times to
:class:`kiln.agent_runner.app.AgentRunnerApp`; ``kiln serve agent-runner`` uses the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


@dataclass(frozen=True)
class RunnerConfig:
    """How the agent runner drives compilations.

    Attributes:
        experiment_deadline_s: ``ExperimentWork.deadline_s``: seconds an engine may spend on one
            candidate (load, check, measure) before it times it out; at most 3600.
        experiment_margin_s: seconds on top of the deadline the runner waits for an engine's
            ``ExperimentCompleted`` (queueing, restarts) before recording the experiment as
            ``timed_out`` itself.
        search_share: the largest share of the wall-clock budget one search-tier candidate
            may take on an engine (its deadline: :meth:`search_deadline_s`), so one slow
            candidate (an 8B model under ``torch_compile(max-autotune)`` took over 100 s on an
            H200) cannot hold the engine for a short search's whole budget.
        search_min_deadline_s: the search-tier deadline never goes below this, seconds.
        plan_timeout_s: deadline of one cost-model ``Plan`` call, seconds.
        plan_attempts: ``Plan`` tries while the cost model is UNAVAILABLE before the
            compilation fails.
        cancel_wait_s: how long ``Cancel`` waits for a local runner to record the end, seconds.
        resume_retry_s: pause between resume attempts while the ledger is unreachable, seconds.
    """

    experiment_deadline_s: float = 300.0
    experiment_margin_s: float = 60.0
    search_share: float = 0.25
    search_min_deadline_s: float = 60.0
    plan_timeout_s: float = 10.0
    plan_attempts: int = 3
    cancel_wait_s: float = 10.0
    resume_retry_s: float = 2.0

    def search_deadline_s(self, wall_seconds: float) -> float:
        """The deadline of a search-tier candidate under a ``wall_seconds`` budget: its
        :attr:`search_share`, within [:attr:`search_min_deadline_s`,
        :attr:`experiment_deadline_s`]."""
        share = max(self.search_min_deadline_s, self.search_share * wall_seconds)
        return min(self.experiment_deadline_s, share)

    @property
    def experiment_timeout_s(self) -> float:
        """Seconds from publishing work to recording it timed out: deadline + margin."""
        return self.experiment_deadline_s + self.experiment_margin_s


class LLMSettings(BaseSettings):
    """The code-writing agent's endpoint (kind ``llm``), from ``KILN_LLM_*``; off by default.

    Any server speaking OpenAI's Chat Completions API works (OpenAI, vLLM, llama.cpp, Ollama):
    the agent POSTs to ``{url}/chat/completions``. With ``KILN_LLM_URL`` unset the ``llm``
    agent kind is refused (:func:`kiln.agent_runner.agents.llm.require_llm`).
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
    """Where the ``optuna`` agent keeps its studies, from ``KILN_OPTUNA_*``.

    ``KILN_OPTUNA_STORAGE`` is a SQLAlchemy URL (optuna's ``RDBStorage``) or ``memory``;
    unset, the study is in memory and a restarted agent rebuilds it from the compilation's
    results. On Postgres the study lives in schema ``KILN_OPTUNA_DB_SCHEMA`` (default
    ``optuna``), apart from any other tables. See
    :func:`kiln.agent_runner.agents.optuna_search.resolve_storage`.
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
