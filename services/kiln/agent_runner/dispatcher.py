"""Requesting experiments and learning their results (the flow of ``kiln.common.work``).

Requesting an experiment (:meth:`ExperimentDispatcher.record`, then
:meth:`ExperimentDispatcher.publish`): append ``ExperimentRequested`` to ``experiment-<new id>``
(expected version: no stream), then publish an :class:`~kiln.common.work.ExperimentWork` on
``ExperimentWork.subject(prefix)`` with ``Nats-Msg-Id`` = the experiment id (and, with tracing on,
the ``kiln.experiment.dispatch`` span's W3C ``traceparent``: :mod:`kiln.common.tracing`).

Learning results: one shared follower of the ledger (``ReadAll`` with follow, types
``ExperimentCompleted`` and ``CompilationCancelRequested``), started from the position before
the first request, resolves a future per experiment and forwards cancel requests. A result is
never taken from an engine directly, so either side may restart at any point.

An experiment nobody answers within its time-out is closed by the runner: it appends an
``ExperimentCompleted`` with status ``timed_out`` at expected version 1; ``Aborted`` there means
an engine answered first, and that answer is used instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Literal

from nats.js import JetStreamContext

from kiln.agent_runner import records
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.experiment import Completed, Requested, completed_of, event_data
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.outage import ride_out
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.common import nats as kn
from kiln.common import tracing
from kiln.common.errors import Aborted, AlreadyExists, KilnError
from kiln.common.logging import get_logger
from kiln.common.work import ExperimentWork
from kiln.domain.candidate import Candidate
from kiln.events.types import Tier

log = get_logger("kiln.agent_runner.dispatcher")

FOLLOWED_TYPES = ("ExperimentCompleted", "CompilationCancelRequested")
"""Event types the shared follower reads."""

CancelHandler = Callable[[str, str], None]
"""Called with (compilation id, reason) for every cancel request the follower reads."""


class ExperimentDispatcher:
    """Queues experiments and resolves their results from the ledger.

    Args:
        ledger: the ledger clients (appends as the experiment's team).
        js: JetStream (the work stream must exist: ``kiln.common.nats.ensure_streams``).
        prefix: the subject prefix.
        config: time-outs.
        on_cancel: told about every ``CompilationCancelRequested`` read after the follower
            started.
    """

    def __init__(
        self,
        ledger: LedgerPool,
        js: JetStreamContext,
        prefix: str,
        config: RunnerConfig,
        on_cancel: CancelHandler,
    ) -> None:
        self._ledger = ledger
        self._js = js
        self._prefix = prefix
        self._config = config
        self._on_cancel = on_cancel
        self._futures: dict[str, asyncio.Future[Completed]] = {}
        self._work_seq: dict[str, int] = {}
        self._follower: asyncio.Task[None] | None = None
        self.followed_position = 0
        """The last position the follower read (0 before it started)."""

    # ---------------------------------------------------------------- requesting
    async def record(
        self,
        *,
        team: str,
        compilation_id: str,
        candidate: Candidate,
        agent: str,
        tier: Tier,
        profile: bool = False,
        baseline: str = "",
    ) -> Requested:
        """Record a new experiment (``ExperimentRequested``) on ``tier`` and start waiting for
        its result; :meth:`publish` then queues its work (``profile``: ask the engine for the
        per-op profile too; ``baseline``: measure that baseline of :mod:`kiln.baselines`
        instead of the candidate).

        Returns:
            The request (its ledger position included); await :meth:`wait` for the result.

        Raises:
            KilnError: the ledger refused it (an unavailable ledger is waited out).
        """
        eid = records.new_experiment_id()
        event = records.experiment_requested(
            compilation_id, eid, candidate, tier, agent, profile, baseline
        )
        client = self._ledger.client(team)
        result = await ride_out(
            lambda: client.append(records.experiment_stream(eid), [event], "no_stream"),
            what="record an experiment",
            compilation=compilation_id,
        )
        req = Requested(
            eid,
            compilation_id,
            team,
            candidate,
            agent,
            tier,
            result.positions[0],
            profile,
            baseline,
        )
        self._register(req)
        return req

    async def publish(
        self, req: Requested, workload: dict[str, Any], deadline_s: float | None = None
    ) -> None:
        """Publish (again) the work item of a recorded experiment; JetStream drops a repeat
        within its duplicate window (``Nats-Msg-Id`` = experiment id). ``deadline_s``: the
        engine's deadline for it (default and cap :meth:`RunnerConfig.deadline_cap_s`: the
        baseline deadline for a baseline's experiment, the experiment deadline otherwise). NATS
        being away is waited out (:func:`~kiln.agent_runner.outage.ride_out`).

        Raises:
            nats.js.errors.APIError: NATS refused it.
        """
        cap = self._config.deadline_cap_s(req.baseline)
        work = ExperimentWork(
            experiment_id=req.experiment_id,
            compilation_id=req.compilation_id,
            team=req.team,
            tier=req.tier,
            candidate=req.candidate.canonical(),
            workload=workload,
            deadline_s=min(deadline_s or cap, cap),
            profile=req.profile,
            baseline=req.baseline,
        )
        with tracing.span(
            "kiln.experiment.dispatch",
            kind="producer",
            compilation_id=req.compilation_id,
            experiment_id=req.experiment_id,
            tier=req.tier,
            candidate_id=req.candidate.id,
            team=req.team,
        ):
            headers = tracing.inject({kn.MSG_ID: req.experiment_id})  # + the W3C traceparent
            ack = await ride_out(
                lambda: self._js.publish(
                    work.subject(self._prefix),  # per (device kind, tier, model)
                    work.to_json(),
                    timeout=10.0,
                    stream=kn.work_stream_name(self._prefix),
                    headers=headers,
                ),
                what="queue an experiment's work",
                compilation=req.compilation_id,
            )
        self._work_seq[req.experiment_id] = ack.seq

    async def adopt(self, req: Requested, workload: dict[str, Any]) -> None:
        """Wait for an experiment requested before a restart: register it; if its result is
        not recorded yet, re-publish its work (same ``Nats-Msg-Id``: harmless if still queued;
        an engine that finds it completed drops it).

        Raises:
            KilnError: the ledger refused. nats.js.errors.APIError: NATS refused the work (both
            being away is waited out).
        """
        self._register(req)
        stream = records.experiment_stream(req.experiment_id)
        events = await ride_out(
            lambda: self._ledger.system.read_stream(stream),
            what="read an experiment",
            compilation=req.compilation_id,
        )
        for event in events:
            if event.type == "ExperimentCompleted":
                self._resolve(completed_of(event))
                return
        await self.publish(req, workload)

    # ---------------------------------------------------------------- waiting
    async def wait(self, req: Requested, timeout_s: float | None = None) -> Completed:
        """The experiment's result; after ``timeout_s`` (default: deadline + margin) without
        one, :meth:`close` it as timed out. Cancelling the caller leaves it pending."""
        timeout = self._config.timeout_s(req.baseline) if timeout_s is None else timeout_s
        future = self._futures.get(req.experiment_id) or self._register(req)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return await self.close(
                req,
                f"no engine answered within {timeout:g} s (deadline "
                f"{self._config.deadline_cap_s(req.baseline):g} s + margin; is the engine pool "
                "running?)",
            )

    async def close(
        self, req: Requested, error: str, status: Literal["timed_out", "cancelled"] = "timed_out"
    ) -> Completed:
        """Record a pending experiment as ``status`` (``timed_out``, or ``cancelled`` when its
        compilation ended) with ``error`` unless an engine has answered (then return that
        answer). Drops its queued work best-effort.

        Raises:
            KilnError: the ledger refused (an unavailable ledger is waited out).
        """
        future = self._futures.get(req.experiment_id)
        if future is not None and future.done():
            return future.result()
        event = records.experiment_unanswered(
            req.compilation_id, req.experiment_id, req.candidate.id, req.tier, error, status
        )
        stream = records.experiment_stream(req.experiment_id)
        client = self._ledger.client(req.team)
        try:
            await ride_out(
                lambda: client.append(stream, [event], 1),
                what="close an experiment",
                compilation=req.compilation_id,
            )
        except (Aborted, AlreadyExists):
            pass  # an engine answered first (or our earlier close did): read what is recorded
        completed = None
        recorded_events = await ride_out(
            lambda: client.read_stream(stream),
            what="read an experiment",
            compilation=req.compilation_id,
        )
        for recorded in recorded_events:
            if recorded.type == "ExperimentCompleted":
                completed = completed_of(recorded)
                break
        if completed is None:
            raise KilnError(f"{stream} has no ExperimentCompleted after closing it")
        self._resolve(completed)
        await self._drop_work(req.experiment_id)
        return completed

    def forget(self, experiment_id: str) -> None:
        """Stop tracking an experiment whose result has been handled."""
        self._futures.pop(experiment_id, None)
        self._work_seq.pop(experiment_id, None)

    def pending(self, experiment_id: str) -> bool:
        """True while the experiment is tracked and has no result."""
        future = self._futures.get(experiment_id)
        return future is not None and not future.done()

    # ---------------------------------------------------------------- internals
    def _register(self, req: Requested) -> asyncio.Future[Completed]:
        future = self._futures.get(req.experiment_id)
        if future is None:
            future = self._futures[req.experiment_id] = asyncio.get_running_loop().create_future()
        if self._follower is None or self._follower.done():
            start = max(0, req.position - 1)
            if self.followed_position:
                start = min(start, self.followed_position)
            self._follower = asyncio.create_task(self._follow(start), name="kiln-ar-follower")
        return future

    def _resolve(self, completed: Completed) -> None:
        future = self._futures.get(completed.experiment_id)
        if future is not None and not future.done():
            future.set_result(completed)

    async def _drop_work(self, experiment_id: str) -> None:
        seq = self._work_seq.get(experiment_id)
        if seq:
            with contextlib.suppress(Exception):
                await self._js.delete_msg(kn.work_stream_name(self._prefix), seq)

    async def _follow(self, after: int) -> None:
        """Read completions and cancel requests after ``after`` forever, reconnecting."""
        while True:
            try:
                async for event in self._ledger.system.read_all(
                    after, follow=True, types=FOLLOWED_TYPES
                ):
                    after = self.followed_position = event.position
                    self._dispatch(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("ledger follower stopped; resuming", after=after, error=str(exc))
                await asyncio.sleep(1.0)

    def _dispatch(self, event: Any) -> None:
        try:
            if event.type == "ExperimentCompleted":
                self._resolve(completed_of(event))
            elif event.type == "CompilationCancelRequested":
                cid = records.stream_suffix(event.stream_id, records.COMPILATION_PREFIX)
                if cid is not None:
                    self._on_cancel(cid, event_data(event).get("reason") or "cancel requested")
        except Exception as exc:  # a malformed event must not stop the follower
            log.warning("cannot use event", position=event.position, error=repr(exc))

    async def close_all(self) -> None:
        """Stop the follower (pending futures stay unresolved)."""
        if self._follower is not None:
            await cancel_and_wait(self._follower)
            self._follower = None
