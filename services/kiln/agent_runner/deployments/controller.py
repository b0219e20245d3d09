"""The controller of one deployment: traffic in, windows, drift decisions, recompilations and
verdicts out, every step an event on the deployment's stream.

It runs as one task per deployment in the agent runner that owns it (:mod:`.host`):

- traffic: the feed from the last recorded window's ``resume_sequence`` (:mod:`.feed`,
  :mod:`.windows`); each closed window is measured against the proven shape, the detector
  decides (:mod:`.decisions`), and ``TrafficWindowObserved`` is appended, with
  ``DriftDetected`` and ``RecompilationStarted`` in the same append when it triggered (and no
  recompilation runs, and the policy's budget allows one). Windows keep being recorded while a
  recompilation runs.
- recompilation: submitted (:mod:`.recompile`) after its ``RecompilationStarted`` is recorded,
  awaited, and judged (:mod:`.promotion`): ``CandidatePromoted`` or ``PromotionDeclined``, the
  detector rebased at the last window's end.

Every append is made at the version the controller folded (optimistic concurrency) under one
lock, measuring included, so the detector's in-memory state follows the stream's order. An
append refused as stale (another replica, a Rollback) re-reads the stream, rebuilds the
detector and decides again; events have deterministic ids, so nothing is recorded twice.
After a SIGKILL the next controller folds the stream, rebuilds the detector, re-reads the feed
from the recorded sequence and waits for (or submits) the recorded recompilation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from google.protobuf.json_format import MessageToDict, ParseDict

from kiln.agent_runner.deployments import records
from kiln.agent_runner.deployments.decisions import ThroughputPredictor, rebuild_detector
from kiln.agent_runner.deployments.feed import TrafficFeed
from kiln.agent_runner.deployments.policy import ResolvedPolicy, policy_from_json
from kiln.agent_runner.deployments.promotion import decide
from kiln.agent_runner.deployments.recompile import (
    CompilerHost,
    submit,
    submit_request,
    wait_ended,
)
from kiln.agent_runner.deployments.windows import WindowTracker
from kiln.common.errors import Aborted, KilnError, ResourceExhausted
from kiln.common.logging import get_logger
from kiln.domain.deployment import DeploymentState, Status
from kiln.events.deployment_types import (
    DriftDetected,
    PromotionDeclined,
    RecompilationStarted,
    TrafficWindowObserved,
)
from kiln.ledger.convert import recorded_to_domain
from kiln.ledger.model import NewEvent
from kiln.v1 import common_pb2, cost_model_pb2_grpc
from kiln.workloads.traffic.drift import measure_drift
from kiln.workloads.traffic.shape import TrafficShape
from kiln.workloads.traffic.windows import TrafficWindow

log = get_logger("kiln.agent_runner.deployments")

FEED_RETRY_S = 2.0
SUBMIT_RETRY_S = 5.0


class ControllerHost(CompilerHost, Protocol):
    """What a controller needs of the agent runner's app."""

    closing: asyncio.Event

    @property
    def feed(self) -> TrafficFeed: ...

    def cost_model_for(self, team: str) -> cost_model_pb2_grpc.CostModelStub: ...


def shape_json(shape: TrafficShape) -> dict[str, Any]:
    """A shape as the events record it (``kiln.v1.TrafficShape`` JSON, field names)."""
    return MessageToDict(shape.to_proto(), preserving_proto_field_name=True)


def shape_of(data: dict[str, Any]) -> TrafficShape:
    """The shape an event recorded."""
    return TrafficShape.from_proto(ParseDict(data, common_pb2.TrafficShape()))


class DeploymentController:
    """One deployment's control loop (see the module docs)."""

    def __init__(self, host: ControllerHost, state: DeploymentState) -> None:
        self.host = host
        self.state = state
        self.policy: ResolvedPolicy = policy_from_json(dict(state.policy), dict(state.drift_policy))
        self.detector = rebuild_detector(self.policy.drift, state.events)
        self.predictor = ThroughputPredictor(host.cost_model_for, state.team, state.workload)
        self._lock = asyncio.Lock()
        self._recompiling: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        """Set (and cleared by waiters) after each event folded."""

    @property
    def deployment_id(self) -> str:
        return self.state.deployment_id

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Run until cancelled (the compilation it waits for keeps running)."""
        try:
            await self._start_pending()
            await self._follow_traffic()
        finally:
            if self._recompiling is not None:
                self._recompiling.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._recompiling

    async def _start_pending(self) -> None:
        """Record the first compilation when none is, and wait for the recorded one."""
        async with self._lock:
            s = self.state
            if s.status == Status.CREATING and s.recompiling is None and not s.compilations:
                payload = RecompilationStarted(
                    compilation_id=records.compilation_id_for(s.deployment_id, 0),
                    reason="initial",
                    shape=dict(s.workload.get("traffic") or {}),
                )
                await self._append_locked([records.started(s.deployment_id, payload)])
        self._watch_recompilation()

    def _watch_recompilation(self) -> None:
        started = self.state.recompiling
        running = self._recompiling is not None and not self._recompiling.done()
        if started is not None and not running:
            self._recompiling = asyncio.create_task(
                self._recompile(dict(started)), name=f"kiln-deployment-{self.deployment_id}-rc"
            )

    async def _follow_traffic(self) -> None:
        while True:
            last = self.state.last_window
            start = int(last["resume_sequence"]) if last else 1
            tracker = WindowTracker(
                self.policy.windows,
                origin_s=float(last["origin_s"]) if last else None,
                closed_before=self.state.next_window_index,
                resume_sequence=start,
            )
            try:
                async for message in self.host.feed.follow(self.deployment_id, start):
                    for window in tracker.add(message):
                        await self._on_window(window, tracker)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "deployment traffic feed failed; re-reading",
                    deployment=self.deployment_id,
                    error=repr(exc)[:300],
                )
                await asyncio.sleep(FEED_RETRY_S)

    # ------------------------------------------------------------------ windows
    async def _on_window(self, window: TrafficWindow, tracker: WindowTracker) -> None:
        async with self._lock:
            while window.index >= self.state.next_window_index:
                events = await self._window_events(window, tracker)
                if await self._append_locked(events):
                    break
        tracker.recorded(window.index)
        self._watch_recompilation()

    async def _window_events(self, window: TrafficWindow, tracker: WindowTracker) -> list[NewEvent]:
        s, policy = self.state, self.policy
        shape = window.shape()
        window_json = shape_json(shape)
        measure = measure_drift(shape_of(dict(s.proven_shape)), shape, policy.drift)
        predicted = None
        if not window.sparse:
            predicted = await self.predictor.predicted_drop(s.proven_shape, window_json)
        decision = self.detector.observe(
            measure, window.end_s, sparse=window.sparse, predicted_drop=predicted
        )
        origin = tracker.origin_s if tracker.origin_s is not None else window.start_s
        reason = decision.reason
        start = decision.triggered and s.recompiling is None and s.status == Status.ACTIVE
        budget = policy.message.max_recompilations
        if decision.triggered and s.recompiling is not None:
            reason += "; a recompilation runs already"
        elif decision.triggered and s.status != Status.ACTIVE:
            reason += f"; the deployment is {s.status}"
            start = False
        elif start and budget and s.recompilations >= budget:
            reason += f"; the recompilation budget is spent ({s.recompilations} of {budget})"
            start = False
        did = s.deployment_id
        events = [
            records.window(
                did,
                TrafficWindowObserved(
                    index=window.index,
                    start_s=window.start_s,
                    end_s=window.end_s,
                    origin_s=origin,
                    requests=len(window.requests),
                    sparse=window.sparse,
                    shape=window_json,
                    drift=measure.to_dict(),
                    drifted=decision.drifted,
                    triggered=decision.triggered,
                    consecutive=decision.consecutive,
                    reason=reason,
                    predicted_drop=predicted,
                    resume_sequence=tracker.resume_after(window.index),
                ),
            )
        ]
        if decision.triggered and s.recompiling is None and s.status == Status.ACTIVE:
            events.append(
                records.drift(
                    did,
                    DriftDetected(
                        window_index=window.index,
                        window_end_s=window.end_s,
                        score=measure.score,
                        dominant=measure.dominant,
                        dimensions=measure.dimensions,
                        normalized=measure.normalized,
                        consecutive=decision.consecutive,
                        reason=reason,
                        predicted_drop=predicted,
                        proven_shape=dict(s.proven_shape),
                        window_shape=window_json,
                    ),
                )
            )
        if start:
            active = s.active
            events.append(
                records.started(
                    did,
                    RecompilationStarted(
                        compilation_id=records.compilation_id_for(did, len(s.compilations)),
                        reason="drift"
                        if measure.score >= policy.drift.threshold
                        else "predicted_drop",
                        window_index=window.index,
                        window_end_s=window.end_s,
                        shape=window_json,
                        warm_start_compilation_ids=list(s.compilations),
                        nearby=policy.message.nearby,
                        incumbent_candidate_id=active.candidate_id if active else "",
                    ),
                )
            )
        return events

    # ------------------------------------------------------------------ recompilation
    async def _recompile(self, started: dict[str, Any]) -> None:
        cid = str(started["compilation_id"])
        s, policy = self.state, self.policy
        request = submit_request(
            cid,
            s.workload,
            dict(started.get("shape") or {}),
            policy.message,
            [c for c in started.get("warm_start_compilation_ids") or [] if c != cid],
            str(started.get("incumbent_candidate_id") or ""),
        )
        while True:
            try:
                fresh = await submit(self.host, s.team, request)
                log.info(
                    "deployment compilation",
                    deployment=s.deployment_id,
                    compilation=cid,
                    submitted=fresh,
                    reason=started["reason"],
                )
                break
            except ResourceExhausted as exc:  # the team's pending queue is full: wait
                log.warning("deployment compilation waits", error=exc.message)
                await asyncio.sleep(SUBMIT_RETRY_S)
            except KilnError as exc:
                await self._verdict(
                    cid,
                    lambda why=exc.message: PromotionDeclined(  # type: ignore[misc]
                        compilation_id=cid,
                        incumbent_candidate_id=str(started.get("incumbent_candidate_id") or ""),
                        reason=f"the compilation could not be submitted: {why}",
                        compilation_failed=True,
                        rebased_at_s=self._rebase_point(started),
                    ),
                )
                return
        compilation = await wait_ended(self.host, cid, self.host.closing)
        margin = policy.message.promotion_margin
        await self._verdict(
            cid,
            lambda: decide(self.state, started, compilation, margin, self._rebase_point(started)),
        )

    def _rebase_point(self, started: dict[str, Any]) -> float | None:
        """Where the detector is rebased after this compilation: the later of its window's end
        and the last recorded window's end (None for the initial compilation)."""
        if started["reason"] == "initial":
            return None
        end = float(started.get("window_end_s") or 0.0)
        last = self.state.last_window
        return max(end, float(last["end_s"])) if last else end

    async def _verdict(self, cid: str, make: Callable[[], Any]) -> None:
        async with self._lock:
            while self.state.recompiling is not None and (
                self.state.recompiling.get("compilation_id") == cid
            ):
                payload = make()
                build = (
                    records.promoted
                    if payload.event_type == "CandidatePromoted"
                    else (records.declined)
                )
                if await self._append_locked([build(self.deployment_id, payload)]):
                    if payload.rebased_at_s is not None:
                        self.detector.rebase(payload.rebased_at_s)
                    log.info(
                        "deployment verdict",
                        deployment=self.deployment_id,
                        compilation=cid,
                        verdict=payload.event_type,
                    )
                    return

    # ------------------------------------------------------------------ appends
    async def _append_locked(self, events: Sequence[NewEvent]) -> bool:
        """Append at the folded version (lock held); True when appended, False when the stream
        had moved (then it is re-read and the detector rebuilt)."""
        client = self.host.ledger.client(self.state.team)
        try:
            await client.append(self.state.stream_id, list(events), self.state.version)
        except Aborted:
            await self.refresh()
            self.detector = rebuild_detector(self.policy.drift, self.state.events)
            return False
        await self.refresh()
        return True

    async def refresh(self) -> None:
        """Fold the events appended since the folded version."""
        client = self.host.ledger.system
        fresh = await client.read_stream(self.state.stream_id, self.state.version + 1)
        for event in fresh:
            self.state.apply(recorded_to_domain(event))
        if fresh:
            self.changed.set()
            self.changed.clear()
