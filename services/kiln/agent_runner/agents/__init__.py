"""Search agents: strategies that propose candidates and coordinate through the board (ideas,
claims) and see every result through the compilation's result feed."""

from kiln.agent_runner.agents.base import Agent, Lab, Outcome, Proposal
from kiln.agent_runner.agents.combiner import CombinerAgent
from kiln.agent_runner.agents.coordinate import CoordinateAgent
from kiln.agent_runner.agents.optuna_search import OptunaAgent
from kiln.agent_runner.agents.profiler import ProfilerAgent
from kiln.agent_runner.agents.random_search import RandomSearchAgent
from kiln.agent_runner.agents.registry import (
    AGENT_KINDS,
    DEFAULT_AGENTS,
    build_agents,
    validate_agents,
)
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.results import Seen

__all__ = [
    "AGENT_KINDS",
    "DEFAULT_AGENTS",
    "Agent",
    "BoardView",
    "CombinerAgent",
    "CoordinateAgent",
    "Lab",
    "OptunaAgent",
    "Outcome",
    "ProfilerAgent",
    "Proposal",
    "RandomSearchAgent",
    "Seen",
    "build_agents",
    "validate_agents",
]
