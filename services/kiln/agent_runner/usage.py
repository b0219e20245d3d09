"""Per-agent spending, projected from a compilation's events.

Device time is ``ExperimentCompleted.device_ms`` (the engine's whole ``Engine.run``), else the
sum of ``phases_ms``; engine builds, queueing and experiments the runner closed itself count 0.
Attributed to ``ExperimentRequested.agent``: the fast-tier reference under ``baseline``, the
runner's confirmations under ``confirm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.events.types import is_counted, is_failure


def device_ms_of(completed: Mapping[str, Any]) -> float:
    """A payload's engine busy time, ms: ``device_ms``, else the sum of ``phases_ms``, else 0."""
    device = float(completed.get("device_ms") or 0.0)
    if device > 0:
        return device
    phases = completed.get("phases_ms") or {}
    return float(sum(float(v) for v in phases.values()))


@dataclass
class AgentUsage:
    """What one agent spent: completed experiments (cancelled excluded), those ok and those
    failed, engine time (ms) and its best correct tokens/s (0 without one).
    """

    agent: str
    experiments: int = 0
    ok: int = 0
    failed: int = 0
    device_ms: float = 0.0
    best_tokens_per_s: float = 0.0

    @property
    def device_s(self) -> float:
        """Engine busy time, seconds."""
        return self.device_ms / 1e3


@dataclass
class UsageBook:
    """Per-agent usage, each experiment counted once whatever order its two events arrive in."""

    agents: dict[str, AgentUsage] = field(default_factory=dict)
    _agent_of: dict[str, str] = field(default_factory=dict)
    _pending: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)

    def request(self, experiment_id: str, agent: str) -> None:
        """An ``ExperimentRequested`` by ``agent``."""
        name = self._agent_of.setdefault(experiment_id, agent or "?")
        self.agents.setdefault(name, AgentUsage(name))
        early = self._pending.pop(experiment_id, None)
        if early is not None:
            self.complete(experiment_id, early)

    def complete(self, experiment_id: str, completed: Mapping[str, Any]) -> None:
        """An ``ExperimentCompleted`` payload (held until its request is known)."""
        if experiment_id in self._done:
            return
        agent = self._agent_of.get(experiment_id)
        if agent is None:
            self._pending[experiment_id] = completed
            return
        self._done.add(experiment_id)
        u = self.agents.setdefault(agent, AgentUsage(agent))
        status = str(completed.get("status", ""))
        u.device_ms += device_ms_of(completed)
        if not is_counted(status):
            return
        u.experiments += 1
        if status == "ok" and completed.get("correct"):
            u.ok += 1
            u.best_tokens_per_s = max(u.best_tokens_per_s, float(completed.get("tokens_per_s", 0)))
        elif is_failure(status):
            u.failed += 1

    @property
    def device_ms(self) -> float:
        """Every agent's engine busy time, ms."""
        return sum(u.device_ms for u in self.agents.values())

    @property
    def experiments(self) -> int:
        """Completed experiments of every agent (``cancelled`` excluded)."""
        return sum(u.experiments for u in self.agents.values())

    def rows(self) -> list[AgentUsage]:
        """The agents, by name."""
        return [self.agents[name] for name in sorted(self.agents)]


def usage_from(payloads: Iterable[tuple[str, str, Mapping[str, Any]]]) -> UsageBook:
    """Fold ``(event type, experiment id, payload)`` triples (other types ignored)."""
    book = UsageBook()
    for kind, eid, data in payloads:
        if kind == "ExperimentRequested":
            book.request(eid, str(data.get("agent", "")))
        elif kind == "ExperimentCompleted":
            book.complete(eid, data)
    return book
