"""The event store: append with optimistic concurrency, idempotent re-append, ordered reads.

Appends are validated here and committed in groups under an advisory lock, so positions become
visible in increasing order and a reader tailing ``position > last_seen`` never skips an event
(docs/design/ledger.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kiln.common.errors import InvalidArgument, NotFound, quote
from kiln.events.registry import SchemaError, parse_stream_id, validate_event
from kiln.ledger.group_commit import GroupCommitter
from kiln.ledger.model import AppendResult, ExpectedVersion, NewEvent, StoredEvent
from kiln.ledger.tables import events

MAX_EVENTS_PER_APPEND = 1000


def row_to_event(row: Any) -> StoredEvent:
    """A row of ``events`` (any select of all its columns) as a StoredEvent."""
    m = row._mapping
    return StoredEvent(
        position=m["position"],
        stream_id=m["stream_id"],
        stream_version=m["stream_version"],
        event_id=str(m["event_id"]),
        type=m["type"],
        schema_version=m["schema_version"],
        data=m["data"],
        metadata=m["metadata"],
        recorded_at=m["recorded_at"],
    )


def _payload_size(data: dict[str, Any] | bytes | str) -> int:
    if isinstance(data, bytes):
        return len(data)
    if isinstance(data, str):
        return len(data.encode())
    return len(json.dumps(data, separators=(",", ":")).encode())


class EventStore:
    """Append-only event store on a migrated PostgreSQL (``postgresql+psycopg://`` engine);
    ``max_event_bytes`` bounds a payload's UTF-8 JSON.
    """

    def __init__(self, engine: AsyncEngine, *, max_event_bytes: int = 1 << 20) -> None:
        self.engine = engine
        self.max_event_bytes = max_event_bytes
        self._committer = GroupCommitter(engine)

    # ------------------------------------------------------------------ validation
    def _validate(
        self,
        stream_id: str,
        new_events: Sequence[NewEvent],
        team: str,
        call_correlation: str | None,
        principal: str | None = None,
    ) -> list[dict[str, Any]]:
        try:
            parse_stream_id(stream_id)
        except SchemaError as exc:
            raise InvalidArgument(str(exc)) from None
        if not new_events:
            raise InvalidArgument("an append needs at least one event")
        if len(new_events) > MAX_EVENTS_PER_APPEND:
            raise InvalidArgument(
                f"{len(new_events)} events in one append; the limit is {MAX_EVENTS_PER_APPEND}"
            )
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        who = {"principal": principal} if principal else {}
        for i, ev in enumerate(new_events):
            try:
                event_id = str(uuid.UUID(ev.event_id))
            except (ValueError, AttributeError, TypeError):
                raise InvalidArgument(
                    f"event {i}: event_id {quote(ev.event_id)} is not a UUID"
                ) from None
            if event_id in seen:
                raise InvalidArgument(f"event {i}: event_id {event_id} appears twice in one append")
            seen.add(event_id)
            size = _payload_size(ev.data)
            if size > self.max_event_bytes:
                raise InvalidArgument(
                    f"event {i} ({quote(ev.type)}): payload is {size} bytes; the limit is "
                    f"{self.max_event_bytes} bytes"
                )
            try:
                version, data = validate_event(stream_id, ev.type, ev.schema_version, ev.data)
            except SchemaError as exc:
                raise InvalidArgument(f"event {i}: {exc}") from None
            rows.append(
                {
                    "event_id": event_id,
                    "type": ev.type,
                    "schema_version": version,
                    "data": data,
                    "metadata": {
                        "team": team,
                        "correlation_id": ev.correlation_id or call_correlation or event_id,
                        "causation_id": ev.causation_id,
                        **who,
                    },
                }
            )
        return rows

    # ------------------------------------------------------------------ append
    async def append(
        self,
        stream_id: str,
        new_events: Sequence[NewEvent],
        expected: ExpectedVersion = "any",
        *,
        team: str,
        correlation_id: str | None = None,
        principal: str | None = None,
    ) -> AppendResult:
        """Append ``new_events`` (1..1000) to ``stream_id`` atomically, recording ``team`` and
        the verified caller's ``principal`` URI (when given) in each one's metadata.

        Returns an AppendResult, ``already_stored`` when all were stored before (nothing
        written).

        Raises:
            InvalidArgument: bad stream id, unknown type or version, a payload failing its schema
                or too large, a malformed or repeated event id.
            AlreadyExists: an event id stored before with other content, or part of the batch
                stored.
            Aborted: the stream's version is not the expected one.
        """
        rows = self._validate(stream_id, new_events, team, correlation_id, principal)
        return await self._committer.submit(stream_id, rows, expected)

    async def close(self) -> None:
        """Stop the group committer (pending appends fail; nothing half-written)."""
        await self._committer.close()

    @staticmethod
    async def _stream_version(conn: AsyncConnection, stream_id: str) -> int:
        version = await conn.scalar(
            select(func.coalesce(func.max(events.c.stream_version), 0)).where(
                events.c.stream_id == stream_id
            )
        )
        return int(version or 0)

    # ------------------------------------------------------------------ reads
    async def stream_version(self, stream_id: str) -> int:
        """The stream's last version (0 when it has no events)."""
        async with self.engine.connect() as conn:
            return await self._stream_version(conn, stream_id)

    async def read_stream(
        self, stream_id: str, from_version: int = 1, max_count: int = 1000
    ) -> tuple[list[StoredEvent], int]:
        """Events of one stream with version >= ``from_version`` and the stream's last version;
        InvalidArgument for a malformed id, NotFound for an empty stream.
        """
        try:
            parse_stream_id(stream_id)
        except SchemaError as exc:
            raise InvalidArgument(str(exc)) from None
        async with self.engine.connect() as conn:
            current = await self._stream_version(conn, stream_id)
            if current == 0:
                raise NotFound(f"stream {quote(stream_id)} has no events")
            result = await conn.execute(
                select(events)
                .where(
                    events.c.stream_id == stream_id, events.c.stream_version >= max(from_version, 1)
                )
                .order_by(events.c.stream_version)
                .limit(max_count)
            )
            return [row_to_event(r) for r in result], current

    async def read_all(
        self,
        after_position: int = 0,
        max_count: int = 1000,
        *,
        types: Sequence[str] = (),
        stream_prefix: str = "",
        team: str | None = None,
    ) -> list[StoredEvent]:
        """Up to ``max_count`` events with position > ``after_position``, in global order
        (positions may have gaps; none appears later below one returned); only ``team``'s
        (metadata) when given.
        """
        query = select(events).where(events.c.position > after_position)
        if team is not None:
            query = query.where(events.c.metadata["team"].astext == team)
        if types:
            query = query.where(events.c.type.in_(list(types)))
        if stream_prefix:
            query = query.where(events.c.stream_id.startswith(stream_prefix, autoescape=True))
        async with self.engine.connect() as conn:
            result = await conn.execute(query.order_by(events.c.position).limit(max_count))
            return [row_to_event(r) for r in result]

    async def stream_team(self, stream_id: str) -> str | None:
        """The team recorded on the stream's first event (its owner), None for an empty stream;
        InvalidArgument for a malformed id."""
        try:
            parse_stream_id(stream_id)
        except SchemaError as exc:
            raise InvalidArgument(str(exc)) from None
        async with self.engine.connect() as conn:
            meta = await conn.scalar(
                select(events.c.metadata).where(
                    events.c.stream_id == stream_id, events.c.stream_version == 1
                )
            )
        return None if meta is None else str(meta.get("team") or "")

    async def head_position(self) -> int:
        """The highest committed position (0 for an empty ledger)."""
        async with self.engine.connect() as conn:
            return int(
                await conn.scalar(select(func.coalesce(func.max(events.c.position), 0))) or 0
            )
