"""Agent kinds by name, the default set, and building the agents of one compilation."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from kiln.agent_runner.agents.base import Agent
from kiln.agent_runner.agents.combiner import CombinerAgent
from kiln.agent_runner.agents.coordinate import CoordinateAgent
from kiln.agent_runner.agents.llm import LLMAgent, require_llm
from kiln.agent_runner.agents.optuna_search import OptunaAgent
from kiln.agent_runner.agents.profiler import ProfilerAgent
from kiln.agent_runner.agents.random_search import RandomSearchAgent
from kiln.common.errors import InvalidArgument, quote

AGENT_KINDS: dict[str, type[Agent]] = {
    CoordinateAgent.kind: CoordinateAgent,
    RandomSearchAgent.kind: RandomSearchAgent,
    LLMAgent.kind: LLMAgent,
    OptunaAgent.kind: OptunaAgent,
    ProfilerAgent.kind: ProfilerAgent,
    CombinerAgent.kind: CombinerAgent,
}
"""Known agent kinds: ``coordinate`` (greedy coordinate descent), ``random`` (random search),
``llm`` (code-writing LLM; refused unless ``KILN_LLM_URL`` is set, never in the default set),
``optuna`` (TPE over the space, learning from every result of the compilation; its study in memory
unless ``KILN_OPTUNA_STORAGE`` names one), ``profiler`` (attacks the op furthest above its
memory roofline, from the engine's per-op profiles), ``combiner`` (composes the best single
moves others found)."""

DEFAULT_AGENTS: tuple[str, ...] = ("coordinate", "optuna", "profiler", "combiner")
"""The agents a compilation runs when the request names none: a local climber
(``coordinate``), a global model-based searcher (``optuna``), a profile-guided one
(``profiler``, which needs the engine's per-op profiles: the runner profiles the baseline)
and one that composes what the others found (``combiner``). ``random`` stays available by
name."""

MAX_AGENTS = 16


def validate_agents(names: Sequence[str]) -> list[str]:
    """The agent kinds to run (the default set for an empty list).

    Raises:
        InvalidArgument: an unknown kind (the message lists the known ones), more than
            ``MAX_AGENTS``, or ``llm`` while ``KILN_LLM_URL`` is unset.
    """
    kinds = [n.strip() for n in names] or list(DEFAULT_AGENTS)
    unknown = sorted({k for k in kinds if k not in AGENT_KINDS})
    if unknown:
        raise InvalidArgument(
            f"unknown agent(s) {', '.join(quote(u, 60) for u in unknown[:5])}"
            f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}: known agents are "
            f"{', '.join(sorted(AGENT_KINDS))}"
        )
    if LLMAgent.kind in kinds:
        require_llm()
    if len(kinds) > MAX_AGENTS:
        raise InvalidArgument(f"at most {MAX_AGENTS} agents per compilation, got {len(kinds)}")
    return kinds


def agent_seed(compilation_id: str, name: str) -> int:
    """A 63-bit seed from the compilation id and the agent's name."""
    digest = hashlib.sha256(f"{compilation_id}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def build_agents(kinds: Sequence[str], compilation_id: str) -> list[Agent]:
    """One agent per entry of ``kinds``; a kind listed more than once gets names ``kind-1``,
    ``kind-2``, ... (else its kind as its name).

    Raises:
        InvalidArgument: as :func:`validate_agents`.
    """
    kinds = validate_agents(kinds)
    counts = Counter(kinds)
    seen: Counter[str] = Counter()
    agents = []
    for kind in kinds:
        seen[kind] += 1
        name = kind if counts[kind] == 1 else f"{kind}-{seen[kind]}"
        agents.append(AGENT_KINDS[kind](name, agent_seed(compilation_id, name)))
    return agents
