"""One compilation, run to its end: plan, baseline, agents, confirmations, best-so-far, budget,
cancel.

The runner is the only writer of its ``compilation-<id>`` stream apart from cancel requests: it
appends with the stream's expected version and, on ``Aborted``, re-reads the stream (that is how
it learns of a cancel requested elsewhere) and retries. Its events, in order:

``CompilationPlanned`` (the cost model's first feasible plan) -> ``BaselineMeasured`` (the
reference candidate on the fast tier) -> ``BestCandidateImproved`` each time a candidate
confirmed on the full tier beats the best so far (the full-tier reference at first) ->
``BaselineCompared`` for each baseline asked for, measured once the search has ended (outside
its wall-clock budget) -> ``TierAgreement`` (fast vs full rank correlation) ->
``CompilationEnded``.

Agents search on the fast tier. When a fast result becomes the fast leader, the runner's
confirmation task (one per compilation, agent ``confirm``) holds the agents' next requests
(the *gate*), waits for their experiments in flight, and measures the reference and then the
leader on the full tier, back to back; :mod:`kiln.agent_runner.judge` says what is due and what
a confirmation proves. Everything it decides is recomputed from the ledger, so a restarted
runner finishes a confirmation cut in half and starts the ones that were due.

It ends ``succeeded`` when the experiment budget or the wall-clock budget is spent or the agents
have nothing left to propose (and the confirmations due are done); an experiment that crashes
or times out (an engine process died, the engine pool restarted) is recorded as such and the
search goes on; ``cancelled`` after a cancel request; ``failed`` with the reason
when the cost model is unreachable or refuses, the baseline does not measure, or every agent
fails. Before ``CompilationEnded`` every requested experiment gets its ``ExperimentCompleted``
(the runner records ``timed_out`` for those no engine answered), so a finished compilation has
no loose ends. When the process stops (shutdown), the runner stops without ending the
compilation; a new process resumes it (:mod:`kiln.agent_runner.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from kiln.agent_runner import records
from kiln.agent_runner.agents import Outcome, build_agents
from kiln.agent_runner.agents.view import result_body
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.comparisons import BaselineComparisons
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.errors import Failure
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import (
    BASELINE_AGENT,
    CONFIRM_AGENT,
    CONFIRM_TIER,
    SEARCH_TIER,
    agreement_text,
    completed_on,
    confirmation_due,
    judgement,
    needs_reference,
    speedup,
    tier_agreement,
)
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.planning import choose_plan
from kiln.agent_runner.resume import orphan_claims
from kiln.agent_runner.space import CandidateSpace, model_space
from kiln.agent_runner.state import CompilationState, ExperimentRecord
from kiln.agent_runner.stream import CompilationStream
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.agent_runner.workload import workload_to_json
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.events.types import EndStatus, Tier, is_failure
from kiln.ledger.model import NewEvent
from kiln.runtime.support import ModelNotSupported
from kiln.v1 import common_pb2
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
        self._cancelled = asyncio.Event()
        """Set once a cancel is known (the baselines, measured after the search, stop on it)."""
        self._stream = CompilationStream(state, deps.ledger.client(state.team), self._stopped)
        self._judge_lock = asyncio.Lock()
        self._requested: set[str] = set()
        """Candidates requested on the search tier (agents measure each once)."""
        self._gate = asyncio.Event()
        """Open (set) unless a confirmation is running: agents wait here before requesting."""
        self._gate.set()
        self._searching = 0
        """Search-tier experiments past the gate and not completed."""
        self._search_idle = asyncio.Event()
        self._search_idle.set()
        self._confirm_slots = 0
        """Experiment slots reserved for the confirmation due."""
        self._confirm_wanted = asyncio.Event()
        self._agents_done = False
        self._in_flight: dict[str, Requested] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workload_json = workload_to_json(state.workload)
        self.failures = 0
        self.agents_measured: dict[str, int] = {}
        self.finished = asyncio.Event()
        """Set when :meth:`run` returns (ended, or stopped by shutdown)."""
        self._compares = BaselineComparisons(
            state, deps.dispatcher, self._workload_json, self._cancelled
        )
        for rec in state.experiments.values():
            if rec.requested.tier == SEARCH_TIER:
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
        """The candidate space of the workload's hardware restricted to what an engine runs for
        the model (:func:`~kiln.agent_runner.space.model_space`): agents draw only from it.

        Raises:
            Failure: kiln cannot build the model, so it has no space (the reason says why).
        """
        if self._space is None:
            hardware = self.state.workload.hardware.name
            model = self.state.workload.model
            try:
                config = json.loads(model.config_json)
                self._space = model_space(
                    self._deps.space(hardware), config, hardware, name=model.name or "model"
                )
            except (ValueError, ModelNotSupported) as exc:
                raise Failure(str(exc)) from exc
            log.info(
                "search space",
                compilation=self.compilation_id,
                dimensions=len(self._space.dims),
                points=self._space.size,
                refused=self._space.support.summary() if self._space.support else [],
            )
        return self._space

    @property
    def board(self) -> Board:
        """The message board."""
        return self._deps.board

    @property
    def workload(self) -> common_pb2.Workload:
        """The compilation's workload (model config, traffic shape, hardware target)."""
        return self.state.workload

    @property
    def experiments_done(self) -> int:
        """Completed experiments (any status, the baseline included)."""
        return self._budget.completed

    def reserve(self) -> bool:
        """Take an experiment slot; False when the experiment budget is spent or the
        compilation is stopping."""
        return not self._stop.is_set() and self._budget.reserve()

    async def acquire(self) -> bool:
        """Take an experiment slot for an agent once no confirmation holds the gate (the
        confirmations due get their slots first), waiting while the last slots are only
        reserved (see :meth:`ExperimentBudget.acquire`); False once the budget is spent or the
        compilation is stopping."""
        if self._stop.is_set() or not await self._budget.acquire(self._gate):
            return False
        if self._stop.is_set():  # stopped while waiting: the slot is not used
            self._budget.release()
            return False
        return True

    def release(self) -> None:
        """Give back an unused slot."""
        self._budget.release()

    async def measure(
        self, candidate: Candidate, agent: str, *, profile: bool = False
    ) -> Outcome | None:
        """Request an experiment on the search tier for a reserved slot (after any
        confirmation under way), wait for it and judge it; ``profile`` asks the engine for the
        per-op profile (``ExperimentCompleted.op_ms``).

        Returns:
            The outcome; None (slot released) when the candidate was requested before in this
            compilation.

        Raises:
            KilnError, nats.errors.Error: the ledger or NATS failed (the slot is released when
                nothing was requested).
        """
        try:
            await self._gate.wait()
        except asyncio.CancelledError:
            self.release()
            raise
        if candidate.id in self._requested:
            self.release()
            return None
        self._requested.add(candidate.id)
        with self._search_busy():
            try:
                req = await self._shielded(
                    self._request(candidate, agent, SEARCH_TIER, profile=profile)
                )
            except Exception:
                self.release()  # nothing was requested (a cancelled caller keeps its slot:
                raise  # the request goes on and is settled when the compilation ends)
            completed = await self._deps.dispatcher.wait(req)
            return await self._shielded(self._complete(req, completed))

    @contextlib.contextmanager
    def _search_busy(self) -> Iterator[None]:
        """Count a search-tier experiment under way (a confirmation waits for none)."""
        self._searching += 1
        self._search_idle.clear()
        try:
            yield
        finally:
            self._searching -= 1
            if self._searching == 0:
                self._search_idle.set()

    # ------------------------------------------------------------------ control
    def request_cancel(self, reason: str) -> None:
        """Stop the compilation as cancelled (the cancel request is already in the ledger)."""
        if self.state.ended:
            return
        if self.state.cancel_reason is None:
            self.state.cancel_reason = reason or "cancel requested"
        self._stopped()

    def _stopped(self) -> None:
        """Stop the search; a cancel (``state.cancel_reason`` set) stops the baselines too."""
        self._stop.set()
        if self.state.cancel_reason is not None:
            self._cancelled.set()

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
            if self._compares.records:  # restarted while the baselines were measured
                status, reason = "succeeded", "the search had ended before a restart"
            else:
                status, reason = await self._search_until_stopped()
            if status == "succeeded" and st.baselines:
                why = f"the search ended ({reason}) before an engine answered"
                await self._settle(why, compares=False)
                await self._compares.run(self._append, self._shielded)
                if st.cancel_reason is not None:
                    status, reason = "cancelled", st.cancel_reason
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
        """Settle every experiment, then append TierAgreement (once a baseline was measured)
        and CompilationEnded (a succeeded one's reason ends with the tier agreement) in one
        atomic append, so no experiment can come between them."""
        self._stop.set()
        await self._settle(f"the compilation ended ({status}) before an engine answered")
        st, events = self.state, []
        agreement = st.tier_agreement
        if st.baseline is not None and agreement is None:
            event = tier_agreement(st)
            assert isinstance(event.data, dict)
            agreement = (int(event.data["n"]), event.data["rho"])
            events.append(event)
        if status == "succeeded" and agreement is not None:
            reason = f"{reason}; {agreement_text(*agreement)}"
        events.append(records.ended(self.compilation_id, status, reason))
        await self._stream.append(*events)
        log.info("compilation ended", compilation=self.compilation_id, status=status, reason=reason)

    async def _settle(self, why: str, *, compares: bool = True) -> None:
        """Wait for requests and judgements under way; close the search's experiments still
        pending, and the baselines' too unless ``compares`` is False (the search ended and the
        baselines are measured next)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        dispatcher = self._deps.dispatcher
        for req in list(self._in_flight.values()):
            completed = await dispatcher.close(req, why, status="cancelled")
            await self._complete(req, completed)
        if compares:
            await self._compares.close_pending(why)

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
            if req.agent != BASELINE_AGENT and req.tier == SEARCH_TIER
        ]
        if self._resumed:
            extra.extend(await self._orphan_claims())
        agents = build_agents(st.agents, st.compilation_id)
        confirming = asyncio.create_task(
            self._confirmations(), name=f"kiln-confirm-{st.compilation_id}"
        )
        try:
            results = await asyncio.gather(
                *(agent.run(self) for agent in agents), *extra, return_exceptions=True
            )
            self._agents_done = True
            self._confirm_wanted.set()
            await asyncio.wait({confirming})
        finally:
            await cancel_and_wait(confirming)
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
            # profiled, so profile-guided agents see where the reference's time goes from the
            # start (one extra eager decode step, after the timed ones)
            await self.measure(ref, BASELINE_AGENT, profile=True)
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
        """After a restart: judge the completed confirmations again, in the order they
        completed, in case a BestCandidateImproved was not recorded before the stop (judging
        one that was recorded gives nothing)."""
        for req, completed in completed_on(self.state, CONFIRM_TIER):
            if not req.candidate.is_reference:
                await self._judge(req, completed)

    async def _finish_adopted(self, req: Requested) -> None:
        """Wait for an experiment requested before a restart and report it for its agent."""
        with self._search_busy():
            completed = await self._deps.dispatcher.wait(req)
            outcome = await self._shielded(self._complete(req, completed))
        await self._post_result(outcome, req.agent)

    # ------------------------------------------------------------------ confirmations
    async def _confirmations(self) -> None:
        """Confirm fast leaders on the full tier until the agents are done and nothing is due
        (see the module docs); failures are logged, and the agents go on without it."""
        try:
            await self._confirm_until_done()
        except Exception as exc:
            log.error("confirmations stopped", compilation=self.compilation_id, exc_info=exc)
        finally:
            self._gate.set()
            self._release_confirm_slots()

    async def _confirm_until_done(self) -> None:
        adopted = sorted(
            (r for r in self._in_flight.values() if r.tier == CONFIRM_TIER),
            key=lambda r: r.position,
        )
        if adopted:  # a confirmation cut by a restart: finish it before anything else
            self._gate.clear()
            for req in adopted:
                await self._finish_full(req)
        while True:
            self._confirm_wanted.clear()
            if confirmation_due(self.state) is None:
                if self._agents_done:
                    return
                self._release_confirm_slots()  # agents waiting for a slot may take them
                self._gate.set()
                await self._confirm_wanted.wait()
                continue
            self._gate.clear()
            await self._search_idle.wait()
            if not await self._confirm_pair():
                self._gate.set()
                if self._agents_done:
                    return  # no slot left for it
                await self._confirm_wanted.wait()

    async def _confirm_pair(self) -> bool:
        """The reference (unless the last full-tier request is one), then the fast leader,
        on the full tier; False when the experiment budget has no room for them."""
        if not self._hold_confirm_slots():
            return False
        if needs_reference(self.state):
            self._confirm_slots -= 1
            await self._measure_full(REFERENCE_CANDIDATE)
        target = confirmation_due(self.state)  # the freshest leader
        if target is None:
            return True
        self._confirm_slots -= 1
        await self._measure_full(target)
        return True

    def _want_confirmation(self) -> None:
        """After a search-tier result: if a confirmation is due, reserve its slots now (before
        the agents take them) and wake the confirmation task."""
        if confirmation_due(self.state) is not None:
            self._hold_confirm_slots()
            self._confirm_wanted.set()

    def _hold_confirm_slots(self) -> bool:
        """Hold the experiment slots the due confirmation needs, all or none (a pair that does
        not fit in the budget leaves its slots to the agents)."""
        need = 1 + int(needs_reference(self.state))
        while self._confirm_slots < need and self.reserve():
            self._confirm_slots += 1
        if self._confirm_slots >= need:
            return True
        self._release_confirm_slots()
        return False

    def _release_confirm_slots(self) -> None:
        while self._confirm_slots:
            self._confirm_slots -= 1
            self.release()

    async def _measure_full(self, candidate: Candidate) -> None:
        """Request ``candidate`` on the full tier for a taken slot, wait for it, judge it."""
        try:
            req = await self._shielded(self._request(candidate, CONFIRM_AGENT, CONFIRM_TIER))
        except Exception:
            self.release()
            raise
        await self._finish_full(req)

    async def _finish_full(self, req: Requested) -> None:
        completed = await self._deps.dispatcher.wait(req)
        await self._shielded(self._complete(req, completed))

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
        if not await self.acquire():
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

    async def _request(
        self, candidate: Candidate, agent: str, tier: Tier, *, profile: bool = False
    ) -> Requested:
        """Record the experiment, track it, queue its work. Work that cannot be queued closes
        the experiment at once (``timed_out`` with the NATS error), so it is never left open."""
        st, dispatcher = self.state, self._deps.dispatcher
        req = await dispatcher.record(
            team=st.team,
            compilation_id=st.compilation_id,
            candidate=candidate,
            agent=agent,
            tier=tier,
            profile=profile,
        )
        self._in_flight[req.experiment_id] = req
        st.experiments[req.experiment_id] = ExperimentRecord(req)
        deadline = None  # a search candidate's share of the budget; the reference's in full
        if tier == SEARCH_TIER and agent != BASELINE_AGENT:
            deadline = self._deps.config.search_deadline_s(st.wall_seconds)
        try:
            await dispatcher.publish(req, self._workload_json, deadline)
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
        """Record the baseline or a new best if it calls for one, and ask for a confirmation
        when a search-tier result makes one due (one judgement at a time)."""
        async with self._judge_lock:
            event = judgement(self.state, req, completed)
            if event is not None:
                await self._append(event)
            if req.tier == SEARCH_TIER:
                self._want_confirmation()
        return Outcome(req.experiment_id, req.candidate, completed, speedup(self.state, completed))

    async def _append(self, event: NewEvent) -> None:
        await self._stream.append(event)
