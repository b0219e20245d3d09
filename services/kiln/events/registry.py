"""The registry of event types: (type, schema version) -> pydantic model and stream category. An
event is accepted only when its type and version are registered, its stream's category is the
type's, and its payload validates (unknown fields forbidden).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from kiln.domain.quoting import quote
from kiln.events.schema import SCHEMAS, EventSchema

_STREAM_RE = re.compile(
    r"^(?P<category>[a-z][a-z0-9_]{0,31})-(?P<id>[A-Za-z0-9_][A-Za-z0-9_-]{0,127})$"
)


class SchemaError(ValueError):
    """An event that cannot be stored: bad stream id, unknown type or version, bad payload."""


@dataclass(frozen=True)
class StreamId:
    """A stream id ``<category>-<id>``: category ``[a-z][a-z0-9_]*`` (<= 32), id
    ``[A-Za-z0-9_-]`` (<= 128), so it is a valid NATS subject token.
    """

    category: str
    id: str

    def __str__(self) -> str:
        return f"{self.category}-{self.id}"


def parse_stream_id(stream_id: str) -> StreamId:
    """Split and check a stream id. Raises SchemaError naming the problem."""
    m = _STREAM_RE.match(stream_id)
    if not m:
        raise SchemaError(
            f"invalid stream id {quote(stream_id)}: expected '<category>-<id>' with category "
            "[a-z][a-z0-9_]* (<=32 chars) and id [A-Za-z0-9_-] (<=128 chars)"
        )
    return StreamId(m["category"], m["id"])


S = TypeVar("S", bound=EventSchema)


def _ensure_loaded() -> None:
    import kiln.events.deployment_types
    import kiln.events.microbenchmarks  # the cost model's tier 2 stream
    import kiln.events.types  # noqa: F401


def registered_types() -> dict[str, list[int]]:
    """Every registered event type with its schema versions."""
    _ensure_loaded()
    return {t: sorted(v) for t, v in sorted(SCHEMAS.items())}


def event_categories() -> dict[str, str]:
    """Every registered event type with the stream category it belongs to (its latest schema's)."""
    _ensure_loaded()
    return {t: v[max(v)].category for t, v in sorted(SCHEMAS.items())}


def latest_version(event_type: str) -> int:
    """The newest schema version of ``event_type``. Raises SchemaError if unregistered."""
    _ensure_loaded()
    versions = SCHEMAS.get(event_type)
    if not versions:
        raise SchemaError(f"event type {quote(event_type)} has no registered schema")
    return max(versions)


def validate_event(
    stream_id: str, event_type: str, schema_version: int, data: bytes | str | dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """Check one event against its schema (``schema_version`` 0: the latest); returns (version
    used, payload as validated JSON). SchemaError naming the problem.
    """
    sid = parse_stream_id(stream_id)
    _ensure_loaded()
    versions = SCHEMAS.get(event_type)
    if not versions:
        raise SchemaError(f"event type {quote(event_type)} has no registered schema")
    version = schema_version or max(versions)
    schema = versions.get(version)
    if schema is None:
        raise SchemaError(
            f"event type {quote(event_type)} has no schema version {version} "
            f"(known: {sorted(versions)})"
        )
    if schema.category != sid.category:
        raise SchemaError(
            f"event type {event_type!r} belongs in '{schema.category}-*' streams, not "
            f"{quote(stream_id)}"
        )
    obj = parse_json_object(event_type, data)
    try:
        model = schema.model_validate(obj)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise SchemaError(f"{event_type} v{version} payload is invalid: {problems}") from None
    return version, model.model_dump(mode="json")


MAX_DEPTH = 32
"""Deepest nesting of objects and arrays a payload may have."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json_object(event_type: str, data: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """Parse a payload as storable JSON: an object, strict (finite numbers), at most
    ``MAX_DEPTH`` deep, no NUL or lone surrogates (jsonb). SchemaError naming the problem.
    """
    if isinstance(data, (bytes, str)):
        try:
            obj = json.loads(data, parse_constant=_reject_constant)
        except RecursionError:
            raise SchemaError(f"{event_type} payload is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise SchemaError(f"{event_type} payload is not valid JSON: {exc}") from None
    else:
        obj = data
    if not isinstance(obj, dict):
        raise SchemaError(f"{event_type} payload must be a JSON object, got {type(obj).__name__}")
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"{event_type} payload is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise SchemaError(
                        f"{event_type} payload key {key!r} at {path or '<root>'} is not a string"
                    )
                _check_text(event_type, key, f"key {path}.{key}")
                stack.append((item, depth + 1, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(event_type, value, path or "<root>")
        elif isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f"{event_type} payload has a non-finite number at {path}")
    return obj


def _check_text(event_type: str, text: str, where: str) -> None:
    if "\x00" in text:
        raise SchemaError(f"{event_type} payload has a NUL character at {where} (not storable)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"{event_type} payload has an unpaired surrogate at {where}") from None


def parse_payload(schema: type[S], data: bytes | dict[str, Any]) -> S:
    """Typed view of a stored payload (for consumers)."""
    obj = json.loads(data) if isinstance(data, bytes) else data
    return schema.model_validate(obj)
