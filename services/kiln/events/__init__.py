"""Event types of the ledger and their schemas (one registry shared by every service)."""

from kiln.events.registry import (
    EventSchema,
    SchemaError,
    StreamId,
    latest_version,
    parse_stream_id,
    registered_types,
    validate_event,
)

__all__ = [
    "EventSchema",
    "SchemaError",
    "StreamId",
    "latest_version",
    "parse_stream_id",
    "registered_types",
    "validate_event",
]
