"""The Ledger gRPC servicer: the event store, projections and replay over kiln.v1.Ledger.

Authorization (kiln.common.policy): Append passes the policy's append rules for each event (only
service principals append; each service its own event types); every event records the team and
the verified principal. A team's reads are scoped to its own records unless cross-team reads are
on: ReadStream of another team's stream is NOT_FOUND with the message an empty stream gets (so a
team cannot learn which ids exist), ReadAll and Query return only its events and rows, and a Query
filter naming another team is PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable, quote
from kiln.common.identity import current_call
from kiln.common.policy import policy_for
from kiln.common.settings import KilnSettings
from kiln.common.stream_limits import StreamLimiter
from kiln.events import registered_types
from kiln.ledger import convert
from kiln.ledger.bounds import (
    MAX_STREAM_ID_CHARS,
    check_position,
    check_text,
    read_count,
)
from kiln.ledger.notifier import CommitNotifier
from kiln.ledger.query import query
from kiln.ledger.replay import replay
from kiln.ledger.store import EventStore
from kiln.ledger.unavailable import unavailable_on_database_errors
from kiln.v1 import ledger_pb2, ledger_pb2_grpc

log = structlog.get_logger("kiln.ledger")

APPENDED = Counter("kiln_ledger_events_appended_total", "Events appended", ["type"])
APPEND_SECONDS = Histogram("kiln_ledger_append_seconds", "Append transaction latency, seconds")

PROJECTION_NAMES = {
    ledger_pb2.PROJECTION_COMPILATIONS: "compilations",
    ledger_pb2.PROJECTION_EXPERIMENTS: "experiments",
    ledger_pb2.PROJECTION_BEST_CANDIDATES: "best_candidates",
}


def _projection_name(value: int) -> str:
    name = PROJECTION_NAMES.get(value)  # type: ignore[call-overload]
    if name is None:
        raise InvalidArgument(f"projection must be one of {sorted(PROJECTION_NAMES.values())}")
    return name


def _check_types(types: Sequence[str]) -> list[str]:
    """The distinct ``types`` (in first-seen order); InvalidArgument naming an unknown one."""
    known = registered_types()
    distinct = list(dict.fromkeys(types))
    unknown = [t for t in distinct if t not in known]
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InvalidArgument(
            f"unknown event type {quote(unknown[0])}{more}; known: {', '.join(known)}"
        )
    return distinct


def _scope(settings: KilnSettings) -> str | None:
    """The one team the current call may read (None: every team's)."""
    return policy_for(settings).read_scope(current_call())


@unavailable_on_database_errors
class LedgerServicer(ledger_pb2_grpc.LedgerServicer):
    """kiln.v1.Ledger over an :class:`EventStore`; errors are ``KilnError`` (mapped by the
    runtime to gRPC status codes; a database that cannot be reached is UNAVAILABLE)."""

    def __init__(
        self,
        store: EventStore,
        engine: AsyncEngine,
        notifier: CommitNotifier,
        settings: KilnSettings,
    ) -> None:
        self.store = store
        self.engine = engine
        self.notifier = notifier
        self.settings = settings
        self.closing = asyncio.Event()
        """Set when the service drains: followers end their streams so shutdown is prompt."""
        self.follows = StreamLimiter(settings.max_follows_per_caller, "ledger follows")
        """Open ``ReadAll`` follows per caller (:mod:`kiln.common.stream_limits`)."""

    async def Append(
        self, request: ledger_pb2.AppendRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.AppendResponse:
        call = current_call()
        policy_for(self.settings).check_append(
            call, request.stream_id, [(e.type, e.data) for e in request.events]
        )
        new_events = [
            convert.event_from_proto(e, call.causation_id, i) for i, e in enumerate(request.events)
        ]
        if request.expected_version.WhichOneof("kind") == "exact":
            check_position("expected_version.exact", request.expected_version.exact)
        expected = convert.expected_from_proto(
            request.expected_version, request.HasField("expected_version")
        )
        with APPEND_SECONDS.time():
            result = await self.store.append(
                request.stream_id,
                new_events,
                expected,
                team=call.team,
                correlation_id=call.correlation_id,
                principal=call.principal.uri if call.principal else None,
            )
        if not result.already_stored:
            for ev in new_events:
                APPENDED.labels(ev.type).inc()
        category, _, entity = request.stream_id.partition("-")
        ids = {"compilation_id": entity} if category == "compilation" else {}
        log.info(
            "appended",
            **ids,
            stream_id=request.stream_id,
            event_ids=[e.event_id for e in new_events],
            positions=result.positions,
            already_stored=result.already_stored,
        )
        return ledger_pb2.AppendResponse(
            positions=result.positions,
            stream_version=result.stream_version,
            already_stored=result.already_stored,
        )

    async def ReadStream(
        self, request: ledger_pb2.ReadStreamRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.ReadStreamResponse:
        from_version = check_position("from_version", request.from_version)
        page = read_count(request.max_count, self.settings.read_page_size)
        scope = _scope(self.settings)
        if scope is not None and await self.store.stream_team(request.stream_id) != scope:
            # the same answer as an empty stream gets: another team's ids stay unknown
            await self.store.read_stream(request.stream_id, 1, 1)  # InvalidArgument, NotFound
            raise NotFound(f"stream {quote(request.stream_id)} has no events")
        events, version = await self.store.read_stream(
            request.stream_id, max(from_version, 1), page
        )
        return ledger_pb2.ReadStreamResponse(
            events=[convert.recorded_to_proto(e) for e in events],
            stream_version=version,
            end_of_stream=not events or events[-1].stream_version >= version,
        )

    async def ReadAll(
        self, request: ledger_pb2.ReadAllRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ledger_pb2.RecordedEvent]:
        types = _check_types(request.types)
        prefix = check_text("stream_prefix", request.stream_prefix, MAX_STREAM_ID_CHARS)
        after = check_position("after_position", request.after_position)
        scope = _scope(self.settings)
        if not request.follow:
            async for event in self._read_all(request, types, prefix, after, scope):
                yield event
            return
        with self.follows.hold(current_call()):
            async for event in self._read_all(request, types, prefix, after, scope):
                yield event

    async def _read_all(
        self,
        request: ledger_pb2.ReadAllRequest,
        types: list[str],
        prefix: str,
        after: int,
        scope: str | None,
    ) -> AsyncIterator[ledger_pb2.RecordedEvent]:
        remaining = request.max_count or None
        page = self.settings.read_page_size
        while True:
            size = min(page, remaining) if remaining else page
            batch = await self.store.read_all(
                after, size, types=types, stream_prefix=prefix, team=scope
            )
            for event in batch:
                yield convert.recorded_to_proto(event)
            if batch:
                after = batch[-1].position
                if remaining is not None:
                    remaining -= len(batch)
                    if remaining <= 0:
                        return
                if len(batch) == size:
                    continue
            if not request.follow:
                return
            if self.closing.is_set():
                raise Unavailable(
                    f"the ledger is shutting down; resume with after_position={after}"
                )
            await self.notifier.wait(self.settings.poll_interval_s)

    async def Query(
        self, request: ledger_pb2.QueryRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.QueryResponse:
        scope = _scope(self.settings)
        filters = dict(request.filter)
        named = filters.get("team")
        if scope is not None and named is not None and named != scope:
            raise PermissionDenied(
                f"team {scope!r} may not query team {named[:80]!r}'s rows: cross-team reads are "
                "off (KILN_CROSS_TEAM_READS, or an operator's certificate)"
            )
        rows, token, checkpoint = await query(
            self.engine,
            _projection_name(request.projection),
            filters,
            limit=request.limit or self.settings.read_page_size,
            page_token=request.page_token,
            team=scope,
        )
        return ledger_pb2.QueryResponse(
            rows_json=[convert.row_to_json(r) for r in rows],
            next_page_token=token,
            checkpoint_position=checkpoint,
        )

    async def Replay(
        self, request: ledger_pb2.ReplayRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.ReplayResponse:
        names = [_projection_name(p) for p in request.projections]
        report = await replay(self.engine, apply=request.apply, names=names)
        log.info(
            "replayed",
            checkpoint=report.checkpoint_position,
            equal=report.equal,
            applied=[p.name for p in report.projections if p.applied],
        )
        response = ledger_pb2.ReplayResponse(
            checkpoint_position=report.checkpoint_position,
            head_position=report.head_position,
            quarantined_events=report.quarantined_events,
            events_replayed=report.events_replayed,
            equal=report.equal,
            duration_s=report.duration_s,
            projections=[
                ledger_pb2.ProjectionReplay(
                    name=p.name,
                    rows_live=p.rows_live,
                    rows_rebuilt=p.rows_rebuilt,
                    equal=p.equal,
                    differences=p.differences,
                    applied=p.applied,
                )
                for p in report.projections
            ],
        )
        response.replayed_at.GetCurrentTime()
        return response
