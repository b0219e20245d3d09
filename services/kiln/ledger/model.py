"""Plain data types of the event store (no gRPC, no SQL): what goes in and what comes out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

ExpectedVersion = Literal["any", "no_stream", "stream_exists"] | int
"""Optimistic-concurrency check on append: ``"any"`` (none), ``"no_stream"`` (the stream has no
events), ``"stream_exists"`` (it has at least one), or the exact last version (``0`` = no
stream). Stream versions start at 1."""


@dataclass(frozen=True)
class NewEvent:
    """An event to append.

    ``data`` is a JSON object (dict, or its UTF-8 JSON text/bytes); ``schema_version`` 0 means the
    type's latest schema. Empty correlation id: the call's, else the event's own id.
    """

    type: str
    data: dict[str, Any] | bytes | str
    event_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    schema_version: int = 0
    correlation_id: str | None = None
    causation_id: str | None = None


@dataclass(frozen=True)
class StoredEvent:
    """An event as recorded: global ``position``, per-stream ``stream_version`` (from 1),
    payload ``data`` as validated, ``metadata`` with team, correlation_id and causation_id."""

    position: int
    stream_id: str
    stream_version: int
    event_id: str
    type: str
    schema_version: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime


@dataclass(frozen=True)
class AppendResult:
    """Positions of the appended events (in order), the stream's version after the append, and
    whether every event had been stored before (an idempotent retry: nothing was written)."""

    positions: list[int]
    stream_version: int
    already_stored: bool
