"""One compilation, run to its end: plan, baseline, agents, best-so-far, budget, cancel.

The runner is the only writer of its ``compilation-<id>`` stream apart from cancel requests: it
appends with the stream's expected version and, on ``Aborted``, re-reads the stream (that is how
it learns of a cancel requested elsewhere) and retries. Its events, in order:

``CompilationPlanned`` (the cost model's first feasible plan) -> ``BaselineMeasured`` (the
reference candidate on the fast tier) -> ``BestCandidateImproved`` each time a correct candidate
beats the best so far (the baseline at first) -> ``CompilationEnded``.

It ends ``succeeded`` when the experiment budget or the wall-clock budget is spent or the agents
have nothing left to propose; ``cancelled`` after a cancel request; ``failed`` with the reason
when the cost model is unreachable or refuses, the baseline does not measure, or every agent
fails. Before ``CompilationEnded`` every requested experiment gets its ``ExperimentCompleted``
(the runner records ``timed_out`` for those no engine answered), so a finished compilation has
no loose ends. When the process stops (shutdown), the runner stops without ending the
compilation; a new process resumes it (:mod:`kiln.agent_runner.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from kiln.agent_runner import records
from kiln.agent_runner.agents import Outcome, build_agents
from kiln.agent_runner.agents.view import result_body
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.errors import Failure
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import BASELINE_AGENT, judgement, speedup
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.planning import choose_plan
from kiln.agent_runner.resume import orphan_claims
from kiln.agent_runner.space import CandidateSpace
from kiln.agent_runner.state import CompilationState, ExperimentRecord
from kiln.agent_runner.stream import CompilationStream
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.agent_runner.workload import workload_to_json
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.events.types import EndStatus, is_failure
from kiln.ledger.model import NewEvent
from kiln.workloads.candidate import REFERENCE_CANDIDATE, Candidate

log = get_logger("kiln.agent_runner.compilation")


@dataclass(frozen=True)
class RunnerDeps:
    """What every runner of one agent-runner process shares.

    Attributes:
        ledger: ledger clients per team.
        dispatcher: requests experiments and resolves results.
        board: the message board.
        cost_model: a ``kiln.v1.CostModel`` stub (grpc.aio) calling as the given team.
        cost_model_addr: its address (for messages).
        space: the candidate space of a hardware target.
        config: tunables.
    """

    ledger: LedgerPool
    dispatcher: ExperimentDispatcher
    board: Board
    cost_model: Callable[[str], Any]
    cost_model_addr: str
    space: Callable[[str], CandidateSpace]
    config: RunnerConfig


class CompilationRunner:
    """Runs one compilation; also the :class:`~kiln.agent_runner.agents.Lab` of its agents.

    Args:
        state: the compilation as its stream (and, after a restart, its experiments) say.
        deps: shared services.
        resumed: True when started by a restart (orphan claims are then measured).
    """

    def __init__(self, state: CompilationState, deps: RunnerDeps, *, resumed: bool = False) -> None:
        self.state = state
        self._deps = deps
        self._resumed = resumed
        self._space: CandidateSpace | None = None
        self._budget = ExperimentBudget(limit=state.max_experiments)
        self._stop = asyncio.Event()
        self._stream = CompilationStream(state, deps.ledger.client(state.team), self._stop.set)
        self._judge_lock = asyncio.Lock()
        self._requested: set[str] = set()
        self._in_flight: dict[str, Requested] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workload_json = workload_to_json(state.workload)
        self.failures = 0
        self.agents_measured: dict[str, int] = {}
        self.finished = asyncio.Event()
        """Set when :meth:`run` returns (ended, or stopped by shutdown)."""
        for rec in state.experiments.values():
            self._requested.add(rec.requested.candidate.id)
            if rec.completed is None:
                self._in_flight[rec.requested.experiment_id] = rec.requested
                self._budget.in_flight += 1
            else:
                self._budget.completed += 1
                self.failures += int(is_failure(rec.completed.result.status))

    # ------------------------------------------------------------------ Lab
    @property
    def compilation_id(self) -> str:
        """The compilation."""
        return self.state.compilation_id

    @property
    def space(self) -> CandidateSpace:
        """The candidate space of the workload's hardware."""
        if self._space is None:
            self._space = self._deps.space(self.state.workload.hardware.name)
        return self._space

    @property
    def board(self) -> Board:
        """The message board."""
        return self._deps.board

    @property
    def experiments_done(self) -> int:
        """Completed experiments (any status, the baseline included)."""
        return self._budget.completed

    def reserve(self) -> bool:
        """Take an experiment slot; False when the experiment budget is spent or the
        compilation is stopping."""
        return not self._stop.is_set() and self._budget.reserve()

    def release(self) -> None:
        """Give back an unused slot."""
        self._budget.release()

    async def measure(self, candidate: Candidate, agent: str) -> Outcome | None:
        """Request an experiment for a reserved slot, wait for it and judge it (best-so-far).

        Returns:
            The outcome; None (slot released) when the candidate was requested before in this
            compilation.

        Raises:
            KilnError, nats.errors.Error: the ledger or NATS failed (the slot is released when
                nothing was requested).
        """
        if candidate.id in self._requested:
            self.release()
            return None
        self._requested.add(candidate.id)
        try:
            req = await self._shielded(self._request(candidate, agent))
        except Exception:
            self.release()  # nothing was requested (a cancelled caller keeps its slot: the
            raise  # request goes on and is settled when the compilation ends)
        completed = await self._deps.dispatcher.wait(req)
        return await self._shielded(self._complete(req, completed))

    # ------------------------------------------------------------------ control
    def request_cancel(self, reason: str) -> None:
        """Stop the compilation as cancelled (the cancel request is already in the ledger)."""
        if self.state.ended:
            return
        if self.state.cancel_reason is None:
            self.state.cancel_reason = reason or "cancel requested"
        self._stop.set()

    async def run(self) -> None:
        """Run to the end (or until cancelled by shutdown, leaving the compilation open)."""
        structlog.contextvars.bind_contextvars(
            compilation_id=self.compilation_id, team=self.state.team
        )
        try:
            await self._run()
        except asyncio.CancelledError:
            log.info("runner stopped; the compilation stays open", compilation=self.compilation_id)
            await asyncio.shield(self._abandon())
            raise
        except Exception as exc:
            log.exception("runner failed", compilation=self.compilation_id)
            with contextlib.suppress(Exception):
                await self._end("failed", f"internal error in the agent runner: {exc!r}")
        finally:
            self.finished.set()

    async def _abandon(self) -> None:
        """Stop the requests and judgements under way (shutdown: a restart redoes them)."""
        await asyncio.gather(*(cancel_and_wait(t) for t in list(self._tasks)))

    async def _run(self) -> None:
        st = self.state
        if st.ended:
            return
        status: EndStatus
        if st.cancel_reason is not None:
            status, reason = "cancelled", st.cancel_reason
        else:
            status, reason = await self._search_until_stopped()
        await self._end(status, reason)

    async def _search_until_stopped(self) -> tuple[EndStatus, str]:
        st = self.state
        remaining = st.wall_seconds - (datetime.now(UTC) - st.submitted_at).total_seconds()
        search = asyncio.create_task(self._search(), name=f"kiln-search-{st.compilation_id}")
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait(
                {search, stopper}, timeout=max(0.0, remaining), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._stop.set()  # agents that miss the cancellation stop at their next step
            await cancel_and_wait(stopper)
            await cancel_and_wait(search)
        if st.cancel_reason is not None:
            return "cancelled", st.cancel_reason
        if search in done:
            exc = search.exception()
            if isinstance(exc, Failure):
                return "failed", exc.reason
            if exc is not None:
                log.error("search failed", compilation=st.compilation_id, exc_info=exc)
                return "failed", f"internal error in the agent runner: {exc!r}"
            return "succeeded", self._done_reason()
        wall = f"the wall-clock budget of {st.wall_seconds:g} s is spent"
        if st.baseline is None:
            return "failed", f"{wall} before the baseline was measured"
        return "succeeded", wall

    def _done_reason(self) -> str:
        b = self._budget
        if b.spent:
            return f"the experiment budget is spent ({b.completed} of {b.limit} experiments)"
        return f"the agents have nothing left to propose ({b.completed} experiments)"

    async def _end(self, status: EndStatus, reason: str) -> None:
        """Settle every experiment, then append CompilationEnded."""
        self._stop.set()
        await self._settle(f"the compilation ended ({status}) before an engine answered")
        await self._append(records.ended(self.compilation_id, status, reason))
        log.info("compilation ended", compilation=self.compilation_id, status=status, reason=reason)

    async def _settle(self, why: str) -> None:
        """Wait for requests and judgements under way; close experiments still pending."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        dispatcher = self._deps.dispatcher
        for req in list(self._in_flight.values()):
            completed = await dispatcher.close(req, why, status="cancelled")
            await self._complete(req, completed)

    # ------------------------------------------------------------------ the search
    async def _search(self) -> None:
        st = self.state
        for req in list(self._in_flight.values()):
            await self._deps.dispatcher.adopt(req, self._workload_json)
        if st.plan is None:
            await self._plan()
        await self._baseline()
        await self._catch_up_best()
        extra: list[Coroutine[Any, Any, Any]] = [
            self._finish_adopted(req)
            for req in list(self._in_flight.values())
            if req.agent != BASELINE_AGENT
        ]
        if self._resumed:
            extra.extend(await self._orphan_claims())
        agents = build_agents(st.agents, st.compilation_id)
        results = await asyncio.gather(
            *(agent.run(self) for agent in agents), *extra, return_exceptions=True
        )
        errors: list[BaseException] = []
        for agent, result in zip(agents, results, strict=False):
            if isinstance(result, BaseException):
                errors.append(result)
                log.error("agent failed", agent=agent.name, exc_info=result)
            else:
                self.agents_measured[agent.name] = result
        for result in results[len(agents) :]:
            if isinstance(result, BaseException):
                log.error("resumed experiment failed", exc_info=result)
        if errors and len(errors) == len(agents):
            raise Failure(f"every agent failed; the first: {errors[0]!r}")

    async def _plan(self) -> None:
        st, cfg = self.state, self._deps.config
        plan = await choose_plan(
            self._deps.cost_model(st.team),
            st.workload,
            addr=self._deps.cost_model_addr,
            timeout_s=cfg.plan_timeout_s,
            attempts=cfg.plan_attempts,
        )
        await self._append(records.planned(st.compilation_id, plan))

    async def _baseline(self) -> None:
        """Measure the reference forward (or finish measuring it after a restart)."""
        st = self.state
        if st.baseline is not None:
            return
        rec = next(
            (r for r in st.experiments.values() if r.requested.agent == BASELINE_AGENT), None
        )
        if rec is not None and rec.completed is not None:
            await self._judge(rec.requested, rec.completed)
        elif rec is not None:
            completed = await self._deps.dispatcher.wait(rec.requested)
            await self._shielded(self._complete(rec.requested, completed))
        else:
            if not self._budget.reserve():
                raise Failure("no experiment slot is left for the baseline")
            ref = REFERENCE_CANDIDATE
            await self.board.claim(
                st.compilation_id, ref.id, BASELINE_AGENT, {"candidate": ref.canonical()}
            )
            await self.measure(ref, BASELINE_AGENT)
        if st.baseline is None:
            rec = next(r for r in st.experiments.values() if r.requested.agent == BASELINE_AGENT)
            result = rec.completed.result if rec.completed else None
            detail = f"{result.status}: {result.error or 'no error given'}" if result else "?"
            raise Failure(f"the baseline (reference forward pass) did not measure: {detail}")
        rec = st.experiments[st.baseline.experiment_id]
        assert rec.completed is not None
        await self.board.post_result(
            st.compilation_id,
            REFERENCE_CANDIDATE.id,
            BASELINE_AGENT,
            result_body(REFERENCE_CANDIDATE, rec.completed.summary(), 1.0),
            msg_id=f"result:{st.baseline.experiment_id}",
        )

    async def _catch_up_best(self) -> None:
        """After a restart: judge the fastest completed candidate in case its
        BestCandidateImproved was not recorded before the stop."""
        done = [
            r
            for r in self.state.experiments.values()
            if r.completed is not None and r.completed.ok and r.requested.agent != BASELINE_AGENT
        ]
        if done:
            top = max(done, key=lambda r: r.completed.result.tokens_per_s if r.completed else 0)
            assert top.completed is not None
            await self._judge(top.requested, top.completed)

    async def _finish_adopted(self, req: Requested) -> None:
        """Wait for an experiment requested before a restart and report it for its agent."""
        completed = await self._deps.dispatcher.wait(req)
        outcome = await self._shielded(self._complete(req, completed))
        await self._post_result(outcome, req.agent)

    async def _orphan_claims(self) -> list[Coroutine[Any, Any, Any]]:
        """Measure candidates claimed before a restart but never requested, for their
        claimants, so no claimed candidate is lost."""
        posts = await self.board.history(self.compilation_id, kinds=["claim"])
        return [
            self._measure_orphan(candidate, agent)
            for candidate, agent in orphan_claims(posts, self._requested)
            if agent != BASELINE_AGENT
        ]

    async def _measure_orphan(self, candidate: Candidate, agent: str) -> None:
        if not self.reserve():
            return
        outcome = await self.measure(candidate, agent)
        if outcome is not None:
            await self._post_result(outcome, agent)

    async def _post_result(self, outcome: Outcome, agent: str) -> None:
        await self.board.post_result(
            self.compilation_id,
            outcome.candidate.id,
            agent,
            result_body(outcome.candidate, outcome.completed.summary(), outcome.speedup),
            msg_id=f"result:{outcome.experiment_id}",
        )

    # ------------------------------------------------------------------ experiments
    async def _shielded(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` as a task that a cancelled caller does not cancel; :meth:`_settle`
        waits for it before the compilation ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _request(self, candidate: Candidate, agent: str) -> Requested:
        """Record the experiment, track it, queue its work. Work that cannot be queued closes
        the experiment at once (``timed_out`` with the NATS error), so it is never left open."""
        st, dispatcher = self.state, self._deps.dispatcher
        req = await dispatcher.record(
            team=st.team, compilation_id=st.compilation_id, candidate=candidate, agent=agent
        )
        self._in_flight[req.experiment_id] = req
        st.experiments[req.experiment_id] = ExperimentRecord(req)
        try:
            await dispatcher.publish(req, self._workload_json)
        except Exception as exc:
            log.error("cannot queue the work", experiment=req.experiment_id, error=repr(exc))
            with contextlib.suppress(Exception):  # else the end of the compilation closes it
                await dispatcher.close(req, f"the work could not be queued on NATS: {exc!r}")
        return req

    async def _complete(self, req: Requested, completed: Completed) -> Outcome:
        """Count a completed experiment (once) and judge it."""
        if self._in_flight.pop(req.experiment_id, None) is not None:
            self._budget.complete()
            self.failures += int(is_failure(completed.result.status))
            self.state.experiments[req.experiment_id] = ExperimentRecord(req, completed)
            self._deps.dispatcher.forget(req.experiment_id)
        return await self._judge(req, completed)

    async def _judge(self, req: Requested, completed: Completed) -> Outcome:
        """Record the baseline or a new best if it calls for one (one judgement at a time)."""
        async with self._judge_lock:
            event = judgement(self.state, req, completed)
            if event is not None:
                await self._append(event)
        return Outcome(req.experiment_id, req.candidate, completed, speedup(self.state, completed))

    async def _append(self, event: NewEvent) -> None:
        await self._stream.append(event)
