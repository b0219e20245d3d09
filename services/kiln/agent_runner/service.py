"""The ``kiln.v1.Compiler`` servicer: Submit, Watch, Get, List, Cancel.

Appends are made as the caller's team. Bad input is refused before anything is appended:
INVALID_ARGUMENT for a missing or malformed workload, budget, agent, baseline, compilation id or
incumbent candidate id; NOT_FOUND for unknown hardware, weights directory or compilation, a warm
start's source compilation or an incumbent candidate the caller's team never measured
(:mod:`kiln.agent_runner.warm_start`); FAILED_PRECONDITION for a Submit whose hardware (or
model) no registered engine pool serves (:mod:`kiln.agent_runner.pools`; what Submit could not
check, or a device count beyond the pools', comes back as notes: trailing metadata
``kiln-submit-notes``, a JSON list of strings); ALREADY_EXISTS for a reused compilation id;
RESOURCE_EXHAUSTED for a Submit while the team has its ``max_pending`` compilations waiting
(below it a Submit over the team's running limit is accepted and waits as PENDING:
:mod:`kiln.agent_runner.admission`); PERMISSION_DENIED for cancelling another team's
compilation; FAILED_PRECONDITION for cancelling one that has ended; OUT_OF_RANGE for a number
beyond its field's range (:mod:`kiln.workloads.config_bounds`,
:mod:`kiln.domain.operating_point`); RESOURCE_EXHAUSTED for a Watch beyond the caller's open
watches (:mod:`kiln.common.stream_limits`).

Reads follow the policy's read scope (:mod:`kiln.common.policy`): a team sees its own
compilations unless cross-team reads are on; another team's id then answers NOT_FOUND exactly as
an unknown id does (Get, Watch, Cancel), and List naming another team or "*" is
PERMISSION_DENIED. Operators and services read every team's; an operator may cancel any
compilation (recorded for the compilation's team).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, Protocol

from kiln.agent_runner import records
from kiln.agent_runner.admission import Admission
from kiln.agent_runner.agents import validate_agents
from kiln.agent_runner.budget import validate_budget
from kiln.agent_runner.comparisons import validate_baselines
from kiln.agent_runner.compilation import CompilationRunner
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.ledger_access import LedgerPool, retry_unavailable
from kiln.agent_runner.lookup import compilation_events, compilation_snapshot
from kiln.agent_runner.pools import EnginePools
from kiln.agent_runner.snapshot import NAME_BY_STATUS, Snapshot, from_row
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.warm_start import resolve_incumbent, resolve_warm_start
from kiln.agent_runner.watch import watch
from kiln.agent_runner.workload import validate_workload
from kiln.common.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kiln.common.identity import (
    SUBMIT_NOTES_METADATA_KEY,
    TEAM_RULE,
    current_call,
    validate_team,
)
from kiln.common.logging import get_logger
from kiln.common.policy import policy_for
from kiln.common.settings import KilnSettings
from kiln.common.stream_limits import StreamLimiter
from kiln.ledger.bounds import check_position, check_text
from kiln.v1 import compiler_pb2, compiler_pb2_grpc

ALL_TEAMS = "*"
"""ListRequest.team that lists every team's compilations."""
DEFAULT_LIST_LIMIT = 100
MAX_CANCEL_CONFLICTS = 10
MAX_LIST_LIMIT = 1000
MAX_REASON_CHARS = 1000
"""Longest cancel reason: a sentence or two for people reading ``compilations show``."""

log = get_logger("kiln.agent_runner.service")


class CompilationHost(Protocol):
    """What the servicer needs of the process it serves in (the agent runner's app): the
    ledger, the tunables, the shutdown signal and the compilations running here."""

    ledger: LedgerPool
    config: RunnerConfig
    admission: Admission
    """The teams' quotas: Submit refuses beyond the pending limit."""
    pools: EnginePools
    """The engine pools' registry: Submit refuses hardware no pool serves."""
    settings: KilnSettings
    """For the policy (:func:`kiln.common.policy.policy_for`)."""
    closing: asyncio.Event
    """Set when shutdown begins: Watch streams end."""

    def reserve_id(self, compilation_id: str) -> bool:
        """Hold a compilation id while it is being submitted; False when it is held or runs."""
        ...

    def release_id(self, compilation_id: str) -> None:
        """Let go of a held id (its runner, if started, keeps it taken)."""
        ...

    def runner(self, compilation_id: str) -> CompilationRunner | None:
        """The runner of a compilation running in this process, else None."""
        ...

    def start_runner(self, state: CompilationState) -> CompilationRunner:
        """Run a compilation in the background."""
        ...


class CompilerServicer(compiler_pb2_grpc.CompilerServicer):
    """kiln.v1.Compiler over a :class:`CompilationHost`; errors are ``KilnError`` (the runtime
    maps them to status codes)."""

    def __init__(self, app: CompilationHost) -> None:
        self._app = app
        self._watches = StreamLimiter(app.settings.max_follows_per_caller, "compilation watches")

    def _scope(self) -> str | None:
        """The one team whose compilations the caller may read (None: every team's)."""
        return policy_for(self._app.settings).read_scope(current_call())

    async def _check_visible(self, compilation_id: str) -> None:
        """NotFound, as for an unknown id, when the caller may not read the compilation."""
        scope = self._scope()
        if scope is None:
            return
        events = await compilation_events(self._app.ledger, compilation_id)
        if events[0].metadata.team != scope:
            raise NotFound(f"no compilation {compilation_id!r}")

    async def Submit(
        self, request: compiler_pb2.SubmitRequest, context: Any
    ) -> compiler_pb2.Compilation:
        """Record a compilation and start running it (once its team's quotas admit it); returns
        it as submitted (PENDING)."""
        team = current_call().team
        valid = validate_workload(request.workload if request.HasField("workload") else None)
        budget = validate_budget(request.budget if request.HasField("budget") else None)
        agents = validate_agents(list(request.agents))
        baselines = validate_baselines(list(request.baselines), valid.hardware)
        cid = request.compilation_id or records.new_compilation_id()
        records.check_compilation_id(cid)
        app, stream = self._app, records.compilation_stream(cid)
        app.admission.check_submit(team)
        scope = self._scope()
        warm, seeds = await resolve_warm_start(
            app.ledger,
            request.warm_start,
            team=team,
            scope=scope,
            workload=valid.to_json(),
            hardware=valid.hardware,
        )
        incumbent = await resolve_incumbent(app.ledger, request.incumbent_candidate_id, scope=scope)
        notes = await app.pools.check(valid.to_json(), request.workload.hardware.num_devices)
        if not app.reserve_id(cid):
            raise AlreadyExists(f"compilation {cid!r} exists already")
        try:
            event = records.submitted(
                cid,
                workload_key=valid.key,
                model_name=valid.model_name,
                hardware=valid.hardware,
                workload=valid.to_json(),
                wall_seconds=budget.wall_seconds,
                max_experiments=budget.max_experiments,
                agents=agents,
                baselines=baselines,
                warm_start=warm,
                seeds=seeds,
                incumbent=incumbent,
            )
            client = app.ledger.client(team)
            try:
                await retry_unavailable(lambda: client.append(stream, [event], "no_stream"))
            except Aborted:
                raise AlreadyExists(
                    f"compilation {cid!r} exists already: choose another compilation_id, or "
                    "leave it empty for a new one"
                ) from None
            events = await retry_unavailable(lambda: client.read_stream(stream))
            app.start_runner(CompilationState.from_events(events))
        finally:
            app.release_id(cid)
        if notes:
            log.info("compilation submitted with notes", compilation=cid, notes=notes)
            if context is not None:  # None: submitted from inside the process (deployments)
                context.set_trailing_metadata(((SUBMIT_NOTES_METADATA_KEY, json.dumps(notes)),))
        snap = Snapshot(cid)
        snap.apply(events[0])
        return snap.message

    async def Get(self, request: compiler_pb2.GetRequest, context: Any) -> compiler_pb2.Compilation:
        """The compilation now (see :func:`kiln.agent_runner.lookup.compilation_snapshot`)."""
        cid = request.compilation_id
        await self._check_visible(cid)
        return await compilation_snapshot(self._app.ledger, cid, self._app.runner(cid))

    async def List(
        self, request: compiler_pb2.ListRequest, context: Any
    ) -> compiler_pb2.ListResponse:
        """Summaries of a team's compilations (default the caller's; "*": all), optionally of one
        status, oldest first, ``limit`` per page (default 100, at most 1000). InvalidArgument for
        a malformed team or unknown status.
        """
        call, scope = current_call(), self._scope()
        team = request.team or call.team or ALL_TEAMS  # an operator naming no team: all
        filters: dict[str, str] = {}
        if team != ALL_TEAMS:
            try:
                filters["team"] = validate_team(team)
            except InvalidArgument:
                raise InvalidArgument(
                    f"malformed team {team[:80]!r} in ListRequest.team: team names must match "
                    f"{TEAM_RULE}, or '*' for every team"
                ) from None
        if scope is not None and team != scope:
            whose = "every team's" if team == ALL_TEAMS else f"team {team!r}'s"
            raise PermissionDenied(
                f"team {scope!r} may not list {whose} compilations: cross-team reads are off "
                "(KILN_CROSS_TEAM_READS, or an operator's certificate)"
            )
        if request.status:
            name = NAME_BY_STATUS.get(request.status)
            if name is None:
                raise InvalidArgument(f"unknown status {request.status}")
            filters["status"] = name
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        page = await self._app.ledger.query_page(
            "compilations", filters, limit=limit, page_token=request.page_token
        )
        return compiler_pb2.ListResponse(
            compilations=[from_row(r) for r in page.rows], next_page_token=page.next_page_token
        )

    async def Cancel(
        self, request: compiler_pb2.CancelRequest, context: Any
    ) -> compiler_pb2.Compilation:
        """Append ``CompilationCancelRequested``; when the compilation runs here, wait up to
        ``cancel_wait_s`` for it to end.
        """
        call, cid = current_call(), records.check_compilation_id(request.compilation_id)
        team, app = call.team, self._app
        operator = call.principal is not None and call.principal.kind == "operator"
        reason = check_text("reason", request.reason, MAX_REASON_CHARS)
        reason = reason or (
            f"cancelled by {call.principal}" if operator else f"cancelled by team {team}"
        )
        event = records.cancel_requested(cid, reason)
        stream = records.compilation_stream(cid)
        for _ in range(MAX_CANCEL_CONFLICTS):
            state = CompilationState.from_events(await compilation_events(app.ledger, cid))
            if state.team != team and not operator:
                if self._scope() is not None:  # it may not even see it
                    raise NotFound(f"no compilation {cid!r}")
                raise PermissionDenied(
                    f"compilation {cid!r} belongs to team {state.team!r}; only that team may "
                    f"cancel it (this call is from team {team!r})"
                )
            client = app.ledger.client(state.team)
            if state.ended:
                raise FailedPrecondition(
                    f"compilation {cid!r} has ended already ({state.end_status})"
                )
            try:  # at the version read, so a compilation that ends meanwhile is not cancelled
                await retry_unavailable(partial(client.append, stream, [event], state.version))
                break
            except Aborted:
                continue
        else:
            raise Aborted(f"compilation {cid!r} keeps changing; try Cancel again")
        runner = app.runner(cid)
        if runner is not None:
            runner.request_cancel(reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runner.finished.wait(), app.config.cancel_wait_s)
        return await compilation_snapshot(app.ledger, cid, app.runner(cid))

    async def Watch(
        self, request: compiler_pb2.WatchRequest, context: Any
    ) -> AsyncIterator[compiler_pb2.CompilationEvent]:
        """History, then live events, until the compilation ends; OutOfRange for an
        ``after_position`` beyond 2^63-1."""
        after = check_position("after_position", request.after_position)
        await self._check_visible(request.compilation_id)
        with self._watches.hold(current_call()):
            async for event in watch(
                self._app.ledger, request.compilation_id, after, self._app.closing
            ):
                yield event
