"""The ``kiln.v1.Deployments`` servicer: Create, Get, List, Watch, ObserveTraffic, Rollback.

A deployment is named by its team and name; a team addresses its own by name alone, and a
reader allowed every team's (an operator, or cross-team reads) as ``team/name``. Another team's
deployment answers NOT_FOUND exactly as an unknown one (its id is derived from the team, so a
team cannot even name it); List naming another team is PERMISSION_DENIED as in the Compiler.
ObserveTraffic is the calling team's only (its certificate's team); Rollback the team's or an
operator's. Bad input: INVALID_ARGUMENT naming the field; ALREADY_EXISTS for a name in use;
FAILED_PRECONDITION for a rollback with no earlier active candidate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from google.protobuf.json_format import MessageToDict

from kiln.agent_runner.deployments import records
from kiln.agent_runner.deployments.feed import TrafficFeed, encode_record
from kiln.agent_runner.deployments.host import (
    DeploymentControllers,
    deployment_ids,
    read_deployment,
)
from kiln.agent_runner.deployments.policy import resolve_policy
from kiln.agent_runner.deployments.view import entry, to_message
from kiln.agent_runner.ledger_access import LedgerPool, retry_unavailable
from kiln.agent_runner.watch import until_closed
from kiln.agent_runner.workload import validate_workload
from kiln.common.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kiln.common.identity import TEAM_RULE, current_call, validate_team
from kiln.common.policy import policy_for
from kiln.common.settings import KilnSettings
from kiln.domain import streams
from kiln.domain.deployment import (
    DeploymentState,
    InvalidName,
    check_name,
    deployment_id,
)
from kiln.events.deployment_types import CandidateRolledBack, DeploymentCreated
from kiln.ledger.bounds import check_position, check_text
from kiln.ledger.convert import recorded_to_domain
from kiln.v1 import deployments_pb2, deployments_pb2_grpc

ALL_TEAMS = "*"
MAX_REASON_CHARS = 1000
MAX_ROLLBACK_CONFLICTS = 10
PUBLISH_EVERY_S = 0.2
"""ObserveTraffic publishes what it has received at least this often (and every 500 records)."""
BATCH = 500


class DeploymentsHost(Protocol):
    """What the servicer needs of the agent runner's app."""

    ledger: LedgerPool
    settings: KilnSettings
    closing: asyncio.Event
    deployments: DeploymentControllers

    @property
    def feed(self) -> TrafficFeed: ...


class DeploymentsServicer(deployments_pb2_grpc.DeploymentsServicer):
    """kiln.v1.Deployments over a :class:`DeploymentsHost`; errors are ``KilnError``."""

    def __init__(self, app: DeploymentsHost) -> None:
        self._app = app

    # ------------------------------------------------------------------ naming
    def _locate(self, name: str, team: str = "", *, own: bool = False) -> tuple[str, str]:
        """(team, deployment id) a name refers to; NotFound when the caller may not read (or,
        ``own``, act on) that team's deployments."""
        call = current_call()
        given_team, _, bare = name.rpartition("/")
        team = given_team or team or call.team
        try:
            bare = check_name(bare)
        except InvalidName as exc:
            raise InvalidArgument(str(exc)) from None
        scope = policy_for(self._app.settings).read_scope(call)
        operator = call.principal is not None and call.principal.kind == "operator"
        if (scope is not None and team != scope) or (own and team != call.team and not operator):
            raise NotFound(f"no deployment {bare!r}")
        return team, deployment_id(team, bare)

    async def _read(self, name: str, team: str = "", *, own: bool = False) -> DeploymentState:
        _, did = self._locate(name, team, own=own)
        try:
            return await read_deployment(self._app.ledger, did)
        except NotFound:
            raise NotFound(f"no deployment {name.rpartition('/')[2]!r}") from None

    # ------------------------------------------------------------------ RPCs
    async def Create(
        self, request: deployments_pb2.CreateDeploymentRequest, context: Any
    ) -> deployments_pb2.Deployment:
        """Record the deployment; its controller starts the first compilation."""
        team = current_call().team
        try:
            name = check_name(request.name)
        except InvalidName as exc:
            raise InvalidArgument(str(exc)) from None
        resolved = resolve_policy(request.policy if request.HasField("policy") else None)
        valid = validate_workload(request.workload if request.HasField("workload") else None)
        did = deployment_id(team, name)
        payload = DeploymentCreated(
            team=team,
            name=name,
            workload=MessageToDict(valid.message, preserving_proto_field_name=True),
            policy=resolved.to_json(),
            drift_policy=dict(resolved.drift.to_dict()),
        )
        client = self._app.ledger.client(team)
        try:
            await retry_unavailable(
                lambda: client.append(
                    streams.deployment_stream(did), [records.created(did, payload)], "no_stream"
                )
            )
        except (Aborted, AlreadyExists):
            raise AlreadyExists(f"deployment {name!r} exists already") from None
        state = await read_deployment(self._app.ledger, did)
        self._app.deployments.start(state)
        return to_message(state)

    async def Get(
        self, request: deployments_pb2.GetDeploymentRequest, context: Any
    ) -> deployments_pb2.Deployment:
        """The deployment now (``history``: with every event summarized)."""
        return to_message(await self._read(request.name), history=request.history)

    async def List(
        self, request: deployments_pb2.ListDeploymentsRequest, context: Any
    ) -> deployments_pb2.ListDeploymentsResponse:
        """A team's deployments (default the caller's; "*": every team's), oldest first."""
        call = current_call()
        team = request.team or call.team or ALL_TEAMS
        if team != ALL_TEAMS:
            try:
                validate_team(team)
            except InvalidArgument:
                raise InvalidArgument(
                    f"malformed team {team[:80]!r}: team names must match {TEAM_RULE}, or '*'"
                ) from None
        scope = policy_for(self._app.settings).read_scope(call)
        if scope is not None and team != scope:
            raise PermissionDenied(
                f"team {scope!r} may not list another team's deployments: cross-team reads are "
                "off (KILN_CROSS_TEAM_READS, or an operator's certificate)"
            )
        ids = await deployment_ids(self._app.ledger, None if team == ALL_TEAMS else team)
        out = []
        for did in ids:
            out.append(to_message(await read_deployment(self._app.ledger, did)))
        return deployments_pb2.ListDeploymentsResponse(deployments=out)

    async def Watch(
        self, request: deployments_pb2.WatchDeploymentRequest, context: Any
    ) -> AsyncIterator[deployments_pb2.DeploymentEvent]:
        """History after ``after_position``, then live events; UNAVAILABLE at shutdown."""
        after = check_position("after_position", request.after_position)
        state = await self._read(request.name)
        first = state.events[0]
        source = self._app.ledger.system.read_all(
            first.position - 1, follow=True, stream_prefix=state.stream_id
        )
        snap: DeploymentState | None = None
        async for recorded in until_closed(source, self._app.closing):
            if recorded.stream_id != state.stream_id:
                continue
            event = recorded_to_domain(recorded)
            if snap is None:
                snap = DeploymentState.created(event)
            else:
                snap.apply(event)
            if event.position > after:
                yield deployments_pb2.DeploymentEvent(entry=entry(event), snapshot=to_message(snap))

    async def ObserveTraffic(
        self, request_iterator: AsyncIterator[deployments_pb2.TrafficRecord], context: Any
    ) -> deployments_pb2.ObserveTrafficResponse:
        """Publish the records on the deployment's traffic subject (see the proto)."""
        records_in = request_iterator.__aiter__()
        first = await anext(records_in, None)
        if first is None:
            raise InvalidArgument("ObserveTraffic got no records: the first names the deployment")
        if not first.deployment:
            raise InvalidArgument("the first TrafficRecord must name the deployment")
        state = await self._read(first.deployment, own=True)
        did, feed = state.deployment_id, self._app.feed
        offset = 0.0
        if first.continue_clock:
            last = await feed.last_arrival(did)
            if last is not None:
                offset = last + 1.0 - first.arrival_s
        batch: list[dict[str, Any]] = []
        accepted = 0
        since = time.monotonic()

        def add(rec: deployments_pb2.TrafficRecord, index: int) -> None:
            arrival = rec.arrival_s + offset
            if not math.isfinite(arrival):
                raise InvalidArgument(f"record {index}: arrival_s must be finite")
            batch.append(
                encode_record(
                    arrival, rec.isl, rec.osl, list(rec.hash_ids), dict(rec.expert_counts)
                )
            )

        add(first, 0)
        index = 1
        async for rec in records_in:
            add(rec, index)
            index += 1
            if len(batch) >= BATCH or time.monotonic() - since >= PUBLISH_EVERY_S:
                await feed.publish(did, batch)
                accepted += len(batch)
                batch, since = [], time.monotonic()
        if batch:
            await feed.publish(did, batch)
            accepted += len(batch)
        if first.close_windows:
            await feed.publish_flush(did)
        return deployments_pb2.ObserveTrafficResponse(
            deployment_id=did, accepted=accepted, offset_s=offset, subject=feed.subject(did)
        )

    async def Rollback(
        self, request: deployments_pb2.RollbackRequest, context: Any
    ) -> deployments_pb2.Deployment:
        """Make the previous active candidate active again (``CandidateRolledBack``)."""
        call = current_call()
        reason = check_text("reason", request.reason, MAX_REASON_CHARS)
        by = str(call.principal) if call.principal is not None else ""
        for _ in range(MAX_ROLLBACK_CONFLICTS):
            state = await self._read(request.name, request.team, own=True)
            if len(state.actives) < 2:
                raise FailedPrecondition(
                    f"deployment {state.name!r} has no earlier active candidate to roll back to"
                )
            now, before = state.actives[-1], state.actives[-2]
            payload = CandidateRolledBack(
                from_candidate_id=now.candidate_id,
                to_candidate_id=before.candidate_id,
                to_compilation_id=before.compilation_id,
                reason=reason or f"rolled back by {by or 'team ' + call.team}",
                by=by,
            )
            client = self._app.ledger.client(state.team)
            try:
                await client.append(
                    state.stream_id,
                    [records.rolled_back(state.deployment_id, payload)],
                    state.version,
                )
                break
            except Aborted:
                continue
        else:
            raise Aborted(f"deployment {request.name!r} keeps changing; try Rollback again")
        controller = self._app.deployments.get(state.deployment_id)
        if controller is not None:
            await controller.refresh()
        return to_message(await read_deployment(self._app.ledger, state.deployment_id))
