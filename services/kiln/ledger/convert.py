"""Conversions between kiln.v1 ledger messages, the store's plain types and the domain's
:class:`kiln.domain.compilation.Event`."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from kiln.common.errors import InvalidArgument
from kiln.domain.compilation import Event
from kiln.ledger.bounds import check_optional_id
from kiln.ledger.model import ExpectedVersion, NewEvent, StoredEvent
from kiln.v1 import ledger_pb2


def expected_from_proto(msg: ledger_pb2.ExpectedVersion, present: bool) -> ExpectedVersion:
    """An ExpectedVersion message as the store's form; an absent message means "any"."""
    if not present:
        return "any"
    kind = msg.WhichOneof("kind")
    if kind is None or kind == "any":
        return "any"
    if kind == "no_stream":
        return "no_stream"
    if kind == "stream_exists":
        return "stream_exists"
    return int(msg.exact)


def expected_to_proto(expected: ExpectedVersion) -> ledger_pb2.ExpectedVersion:
    """The store's expected version as a message."""
    msg = ledger_pb2.ExpectedVersion()
    if expected == "any":
        msg.any.SetInParent()
    elif expected == "no_stream":
        msg.no_stream.SetInParent()
    elif expected == "stream_exists":
        msg.stream_exists.SetInParent()
    elif isinstance(expected, int) and expected >= 0:
        msg.exact = expected
    else:
        raise InvalidArgument(f"invalid expected version {expected!r}")
    return msg


def event_from_proto(
    msg: ledger_pb2.EventData, default_causation: str | None, index: int = 0
) -> NewEvent:
    """An EventData as a NewEvent. Raises InvalidArgument for a missing event id (clients
    choose ids so that a retried append is recognised) or a correlation or causation id that is
    not printable text of at most 128 characters."""
    if not msg.event_id:
        raise InvalidArgument(
            f"event {index}: event_id is required (a UUID the client chooses, so retries are "
            "idempotent)"
        )
    check_optional_id(f"event {index}: correlation_id", msg.correlation_id)
    check_optional_id(f"event {index}: causation_id", msg.causation_id)
    return NewEvent(
        type=msg.type,
        data=bytes(msg.data),
        event_id=msg.event_id,
        schema_version=msg.schema_version,
        correlation_id=msg.correlation_id or None,
        causation_id=msg.causation_id or default_causation,
    )


def event_to_proto_data(event: NewEvent) -> ledger_pb2.EventData:
    """A NewEvent as the EventData a client sends."""
    data = event.data
    raw = (
        data
        if isinstance(data, bytes)
        else (data.encode() if isinstance(data, str) else _json(data))
    )
    return ledger_pb2.EventData(
        event_id=event.event_id,
        type=event.type,
        schema_version=event.schema_version,
        data=raw,
        correlation_id=event.correlation_id or "",
        causation_id=event.causation_id or "",
    )


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _timestamp(dt: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(dt)
    return ts


def recorded_to_proto(event: StoredEvent) -> ledger_pb2.RecordedEvent:
    """A stored event as a RecordedEvent (payload re-encoded as compact JSON)."""
    meta = event.metadata
    return ledger_pb2.RecordedEvent(
        position=event.position,
        stream_id=event.stream_id,
        stream_version=event.stream_version,
        event_id=event.event_id,
        type=event.type,
        schema_version=event.schema_version,
        data=_json(event.data),
        metadata=ledger_pb2.EventMetadata(
            correlation_id=meta.get("correlation_id") or "",
            causation_id=meta.get("causation_id") or "",
            team=meta.get("team") or "",
            principal=meta.get("principal") or "",
        ),
        recorded_at=_timestamp(event.recorded_at),
    )


def row_to_json(row: dict[str, Any]) -> str:
    """A projection row as one JSON object (times as ISO 8601 text, None as null, columns in
    table order)."""
    return json.dumps(
        {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()},
        ensure_ascii=False,
    )


def recorded_data(event: ledger_pb2.RecordedEvent) -> dict[str, Any]:
    """A recorded event's payload as a dict ({} when it is not a JSON object)."""
    data = json.loads(event.data or b"{}")
    return data if isinstance(data, dict) else {}


def recorded_time(event: ledger_pb2.RecordedEvent) -> datetime:
    """When the ledger recorded ``event`` (UTC)."""
    return event.recorded_at.ToDatetime(tzinfo=UTC)


def recorded_to_domain(event: ledger_pb2.RecordedEvent) -> Event:
    """A recorded event as the domain folds read it (:class:`kiln.domain.compilation.Event`)."""
    return Event(
        type=event.type,
        data=recorded_data(event),
        stream_id=event.stream_id,
        version=event.stream_version,
        position=event.position,
        recorded_at=recorded_time(event),
        team=event.metadata.team,
    )
