"""Tunables of the agent runner that ``KilnSettings`` does not carry (defaults suit a real pool).

Tests pass a :class:`RunnerConfig` with short times to
:class:`kiln.agent_runner.app.AgentRunnerApp`; ``kiln serve agent-runner`` uses the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    """How the agent runner drives compilations.

    Attributes:
        experiment_deadline_s: ``ExperimentWork.deadline_s``: seconds an engine may spend on one
            candidate (load, check, measure) before it times it out; at most 3600.
        experiment_margin_s: seconds on top of the deadline the runner waits for an engine's
            ``ExperimentCompleted`` (queueing, restarts) before recording the experiment as
            ``timed_out`` itself.
        plan_timeout_s: deadline of one cost-model ``Plan`` call, seconds.
        plan_attempts: ``Plan`` tries while the cost model is UNAVAILABLE before the
            compilation fails.
        cancel_wait_s: how long ``Cancel`` waits for a local runner to record the end, seconds.
        resume_retry_s: pause between resume attempts while the ledger is unreachable, seconds.
    """

    experiment_deadline_s: float = 300.0
    experiment_margin_s: float = 60.0
    plan_timeout_s: float = 10.0
    plan_attempts: int = 3
    cancel_wait_s: float = 10.0
    resume_retry_s: float = 2.0

    @property
    def experiment_timeout_s(self) -> float:
        """Seconds from publishing work to recording it timed out: deadline + margin."""
        return self.experiment_deadline_s + self.experiment_margin_s
