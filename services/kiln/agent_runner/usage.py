"""Per-agent spending, projected from a compilation's events.

Device time: an experiment's engine busy time is ``ExperimentCompleted.device_ms`` — the
engine's whole ``Engine.run`` (its phases ``phases_ms`` plus fingerprinting, restoring the
engine and reading memory), in ms. Events from engines that did not report it (older events)
count the sum of ``phases_ms`` instead. Not counted anywhere: an engine's build (weights, caches,
warm-up: shared by every experiment of the engine), queueing, and experiments the runner closed
itself (``timed_out`` / ``cancelled`` with no engine answer: 0 ms).

Attribution: to ``ExperimentRequested.agent``. The reference on the fast tier counts under
``baseline``; the runner's full-tier confirmations (reference and candidates) under ``confirm``
(:data:`kiln.domain.judging.CONFIRM_AGENT`).

The best-so-far curve is :mod:`kiln.domain.curve`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.events.types import is_counted, is_failure


def device_ms_of(completed: Mapping[str, Any]) -> float:
    """An ``ExperimentCompleted`` payload's engine busy time, ms: ``device_ms`` when set, else
    the sum of ``phases_ms`` (0 for neither)."""
    device = float(completed.get("device_ms") or 0.0)
    if device > 0:
        return device
    phases = completed.get("phases_ms") or {}
    return float(sum(float(v) for v in phases.values()))


@dataclass
class AgentUsage:
    """What one agent spent.

    Attributes:
        agent: its name (``baseline`` and ``confirm`` for the runner's own experiments).
        experiments: completed experiments (``cancelled`` ones excluded).
        ok: those measured correct.
        failed: those incorrect, crashed, timed out or rejected.
        device_ms: engine busy time, ms (see the module docstring).
        best_tokens_per_s: the most tokens/s among its correct results (0 without one).
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
    """Per-agent usage folded from ``ExperimentRequested`` / ``ExperimentCompleted`` payloads
    (each experiment counted once, whatever the order of delivery of its two events)."""

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
