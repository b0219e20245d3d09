"""The code-writing agent (kind ``llm``): an LLM behind an OpenAI-compatible endpoint writes op
implementations as code modules. Off unless ``KILN_LLM_URL`` is set.

Each proposal picks a target op of the space (:meth:`LLMAgent.pick_op`), asks the LLM for a
faster implementation, validates the reply and proposes the best candidate so far with that op
replaced and the module added. A candidate an engine would refuse is dropped as an unusable
reply. An unusable reply or an unavailable endpoint is posted on the board as an idea note
(``llm-note-<hash>``) and the agent asks again, showing why; after ``KILN_LLM_MAX_BAD_REPLIES``
in a row, or at once on a 4xx refusal, it stops proposing.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.agent_runner.agents.base import Agent, Lab, Proposal, slot_left
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.config import LLMSettings
from kiln.agent_runner.llm.client import ChatClient
from kiln.agent_runner.llm.errors import LLMError, LLMReplyError, LLMRequestError
from kiln.agent_runner.llm.history import op_profile
from kiln.agent_runner.llm.parse import ParsedModule, parse_completion, triton_available
from kiln.agent_runner.llm.prompt import WorkloadFacts, build_messages
from kiln.agent_runner.space import CandidateSpace
from kiln.common.errors import InvalidArgument
from kiln.common.logging import get_logger
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate

log = get_logger("kiln.agent_runner.llm_agent")

MAX_NOTES = 5
"""Rejected-reply reasons the agent keeps showing the LLM."""
WHY_CHARS = 1500
"""Longest ``why`` of a proposal (the model's explanation), characters."""


def require_llm(settings: LLMSettings | None = None) -> LLMSettings:
    """The LLM settings (``settings``, else ``KILN_LLM_*``); InvalidArgument if ``KILN_LLM_URL``
    is unset.
    """
    settings = settings if settings is not None else LLMSettings()
    if not (settings.url or "").strip():
        raise InvalidArgument(
            "agent 'llm' is off: set KILN_LLM_URL on the agent runner to an OpenAI-compatible "
            "endpoint (e.g. http://127.0.0.1:8000/v1), with KILN_LLM_MODEL and, if the server "
            "needs one, KILN_LLM_API_KEY"
        )
    return settings


def workload_facts(lab: object) -> WorkloadFacts:
    """Hardware and model facts of ``lab``'s ``workload`` (or ``state.workload``); empty without
    one.
    """
    workload: Any = getattr(lab, "workload", None)
    if workload is None:
        workload = getattr(getattr(lab, "state", None), "workload", None)
    if workload is None:
        return WorkloadFacts()
    try:
        return WorkloadFacts(
            hardware=str(workload.hardware.name),
            model=str(workload.model.name),
            batch=int(workload.traffic.batch_size) or None,
            context=int(workload.traffic.context_len) or None,
            dtype=str(workload.model.dtype),
        )
    except (AttributeError, TypeError, ValueError):
        return WorkloadFacts()


def target_ops(space: CandidateSpace) -> list[str]:
    """The ops the space varies, in its order."""
    return [d.op for d in space.dims if d.op is not None]


def with_module(base: Candidate, parsed: ParsedModule) -> Candidate:
    """``base`` with ``ops[op] = impl`` and the module added, replacing an earlier LLM module of
    the op.
    """
    ops = {**dict(base.ops), parsed.op: parsed.impl}
    prefix = f"llm_{parsed.op}_"
    modules = [m for m in base.code_modules if not m.name.startswith(prefix)]
    return Candidate.make(ops, list(base.transforms), [*modules, parsed.module], base.lossy)


class LLMAgent(Agent):
    """Asks an LLM for op implementations; ``client`` (tests) or one built from ``settings`` on
    first use and closed when :meth:`run` ends. InvalidArgument when the adapter is off.
    """

    kind = "llm"
    wants_profiles = True  # op_ms on its results steers the next target op

    def __init__(
        self,
        name: str,
        seed: int,
        settings: LLMSettings | None = None,
        *,
        client: ChatClient | None = None,
    ) -> None:
        super().__init__(name, seed)
        self.settings = require_llm(settings)
        self._client = client
        self._own_client = client is None
        self._attempts: Counter[str] = Counter()
        self._notes: list[str] = []
        self.bad_in_row = 0
        self.stopped = False

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """Unused: this agent proposes through :meth:`next_proposal`."""
        return None

    def client(self) -> ChatClient:
        """The chat client (built from the settings on first use)."""
        if self._client is None:
            s = self.settings
            self._client = ChatClient(
                s.url or "",
                s.model,
                api_key=s.api_key.get_secret_value() if s.api_key else None,
                timeout_s=s.timeout_s,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                attempts=s.attempts,
                backoff_s=s.backoff_s,
            )
        return self._client

    async def run(self, lab: Lab) -> int:
        """:meth:`Agent.run`, closing the client it built at the end."""
        try:
            return await super().run(lab)
        finally:
            if self._own_client and self._client is not None:
                await self._client.close()
                self._client = None

    def pick_op(self, targets: Sequence[str], op_ms: Mapping[str, float]) -> str:
        """The largest ``op_ms / (1 + attempts)`` when the profile covers a target, else the
        least-asked op.
        """
        profiled = any(op_ms.get(op, 0.0) > 0 for op in targets)

        def score(op: str) -> tuple[float, int]:
            ms = op_ms.get(op, 0.0) if profiled else 1.0
            return (-ms / (1 + self._attempts[op]), targets.index(op))

        return min(targets, key=score)

    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """Ask the LLM until a reply makes a new candidate (at most ``max_bad_replies`` in a
        row); None once stopped or when the budget is spent.
        """
        targets = target_ops(lab.space)
        if self.stopped or not targets:
            return None
        if not await slot_left(lab):  # do not pay for a completion nobody measures
            return None
        facts = workload_facts(lab)
        triton = facts.hardware.strip().lower() not in ("", "cpu") and triton_available()
        while self.bad_in_row < self.settings.max_bad_replies:
            bodies = lab.results.bodies()
            op = self.pick_op(targets, op_profile(bodies))
            self._attempts[op] += 1
            messages = build_messages(
                op,
                facts=facts,
                results=bodies,
                notes=self._notes,
                history_chars=self.settings.history_chars,
                triton=triton,
            )
            text = ""
            try:
                completion = await self.client().complete(messages)
                text = completion.text
                parsed = parse_completion(text, op, triton=triton)
                proposal = self._proposal(view, parsed, completion.model)
                self._check_supported(lab.space, parsed, proposal)
            except LLMRequestError as exc:
                log.error("llm agent stops: the endpoint refused", agent=self.name, error=str(exc))
                await self._note(lab, op, exc.message, text)
                self.stopped = True
                return None
            except LLMError as exc:
                self.bad_in_row += 1
                log.warning(
                    "llm reply unusable",
                    agent=self.name,
                    op=op,
                    error=exc.message,
                    in_a_row=self.bad_in_row,
                )
                if isinstance(exc, LLMReplyError):  # shown to the LLM on its next try
                    self._notes = [*self._notes, f"{op}: {exc.message}"][-MAX_NOTES:]
                await self._note(lab, op, exc.message, text)
                continue
            self.bad_in_row = 0
            return proposal
        log.warning("llm agent stops: too many unusable replies", agent=self.name)
        self.stopped = True
        return None

    def _proposal(self, view: BoardView, parsed: ParsedModule, model: str) -> Proposal:
        ranked = view.ranked()
        base = ranked[0].candidate if ranked else REFERENCE_CANDIDATE
        candidate = with_module(base, parsed)
        if candidate.id in view.claimed or candidate.id in self.tried:
            raise LLMReplyError(f"the module for {parsed.op} is one tried before; write another")
        why = f"LLM {model} wrote {parsed.op}={parsed.impl} on {base.describe()}"
        if parsed.explanation:
            why += f": {parsed.explanation}"
        return Proposal(candidate, why[:WHY_CHARS])

    def _check_supported(
        self, space: CandidateSpace, parsed: ParsedModule, proposal: Proposal
    ) -> None:
        """Raise LLMReplyError with the engine's reason if an engine would refuse ``proposal``."""
        reason = space.refusal(proposal.candidate)
        device = space.support.device_type if space.support is not None else None
        if reason is None and device and parsed.devices and device not in parsed.devices:
            reason = (
                f"{parsed.op}={parsed.impl} is registered for {', '.join(parsed.devices)} "
                f"only; this compilation's engines run on {device}"
            )
        if reason is not None:
            log.warning(
                "llm proposal dropped: outside the model's search space",
                agent=self.name,
                candidate=proposal.candidate.describe(),
                reason=reason,
            )
            raise LLMReplyError(f"an engine would refuse that candidate: {reason}")

    async def _note(self, lab: Lab, op: str, reason: str, text: str) -> None:
        """Post a rejected reply on the board as an idea note (best effort)."""
        digest = hashlib.sha256(f"{self.name}:{op}:{reason}:{text}".encode()).hexdigest()[:16]
        body = {"note": "rejected LLM reply", "op": op, "reason": reason, "excerpt": text[:400]}
        try:
            await lab.board.post_idea(lab.compilation_id, f"llm-note-{digest}", self.name, body)
        except Exception as exc:
            log.warning("llm note not posted", agent=self.name, error=str(exc))
