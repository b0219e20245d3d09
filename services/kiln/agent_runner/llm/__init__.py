"""The code-writing agent's parts: an OpenAI-compatible client, the prompt, and the parser that
turns a completion into a validated code module. The agent itself is
:mod:`kiln.agent_runner.agents.llm`; it is off unless ``KILN_LLM_URL`` is set."""

from kiln.agent_runner.llm.client import ChatClient, Completion
from kiln.agent_runner.llm.errors import LLMError, LLMReplyError, LLMRequestError, LLMUnavailable
from kiln.agent_runner.llm.parse import ParsedModule, parse_completion
from kiln.agent_runner.llm.prompt import WorkloadFacts, build_messages

__all__ = [
    "ChatClient",
    "Completion",
    "LLMError",
    "LLMReplyError",
    "LLMRequestError",
    "LLMUnavailable",
    "ParsedModule",
    "WorkloadFacts",
    "build_messages",
    "parse_completion",
]
