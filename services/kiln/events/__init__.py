"""Event types of the ledger and their schemas (one registry shared by every service)."""

from kiln.events.registry import (
    SchemaError,
    StreamId,
    latest_version,
    parse_stream_id,
    registered_types,
    validate_event,
)
from kiln.events.schema import EventSchema

__all__ = [
    "EventSchema",
    "SchemaError",
    "StreamId",
    "latest_version",
    "parse_stream_id",
    "registered_types",
    "validate_event",
]
