"""How the CLI shows things: rich tables for people, JSON lines for programs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kiln.embedded.supervisor import ComponentStatus

console = Console(highlight=False)
"""Console for results (stdout)."""

DATA_WIDTH = 96
"""Characters of an event's data shown in a table before it is cut."""


def compact_json(value: Any) -> str:
    """``value`` as JSON without spaces."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def event_data(event: Any) -> Any:
    """The event's data decoded from JSON (the raw text when it is not JSON)."""
    raw = bytes(event.data)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw.decode("utf-8", "replace")


def recorded_at(event: Any) -> str:
    """The event's commit time, ISO 8601 in UTC with milliseconds ("" when unset)."""
    if not event.HasField("recorded_at"):
        return ""
    return event.recorded_at.ToDatetime(tzinfo=UTC).isoformat(timespec="milliseconds")


def event_dict(event: Any) -> dict[str, Any]:
    """A RecordedEvent as a plain dict (data decoded), for ``--json``."""
    return {
        "position": event.position,
        "stream_id": event.stream_id,
        "stream_version": event.stream_version,
        "event_id": event.event_id,
        "type": event.type,
        "schema_version": event.schema_version,
        "team": event.metadata.team,
        "correlation_id": event.metadata.correlation_id,
        "causation_id": event.metadata.causation_id,
        "recorded_at": recorded_at(event),
        "data": event_data(event),
    }


def _cut(text: str, width: int = DATA_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def event_cells(event: Any) -> list[str]:
    """The table cells of one event."""
    return [
        str(event.position),
        event.stream_id,
        str(event.stream_version),
        event.type,
        event.metadata.team,
        recorded_at(event),
        _cut(compact_json(event_data(event))),
    ]


EVENT_COLUMNS = ("pos", "stream", "ver", "type", "team", "recorded_at", "data")


def events_table(events: Iterable[Any], title: str | None = None) -> Table:
    """A table of events, one row each."""
    table = Table(*EVENT_COLUMNS, title=title, title_justify="left")
    for event in events:
        table.add_row(*event_cells(event))
    return table


def event_line(event: Any) -> Text:
    """One event on one line (``kiln ledger tail --follow``)."""
    pos, stream, ver, type_, team, at, data = event_cells(event)
    line = Text()
    line.append(f"{pos:>6} ", style="bold")
    line.append(f"{at} ", style="dim")
    line.append(f"{stream}@{ver} ", style="cyan")
    line.append(f"{type_} ", style="green")
    line.append(f"[{team}] ", style="magenta")
    line.append(data)
    return line


def print_json_lines(items: Iterable[dict[str, Any]]) -> None:
    """Print each item as one JSON line on stdout."""
    for item in items:
        print(compact_json(item), flush=True)


def rows_table(rows: Sequence[dict[str, Any]], title: str | None = None) -> Table:
    """A table of projection rows; columns in order of first appearance."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    table = Table(*columns, title=title, title_justify="left")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    return table


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return _cut(compact_json(value), 60)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _mark(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("no", style="red")


def replay_table(response: Any) -> Table:
    """A table of a ReplayResponse: per projection, rows live/rebuilt and whether equal."""
    table = Table("projection", "rows live", "rows rebuilt", "equal", "applied")
    for proj in response.projections:
        table.add_row(
            proj.name,
            str(proj.rows_live),
            str(proj.rows_rebuilt),
            _mark(proj.equal),
            "yes" if proj.applied else "",
        )
    table.title = (
        f"replay of {response.events_replayed} events up to position "
        f"{response.checkpoint_position} in {response.duration_s:.2f}s"
    )
    table.title_justify = "left"
    return table


def status_table(rows: Iterable[ComponentStatus]) -> Table:
    """``kiln status``: component, pid, address, healthy, note."""
    table = Table("component", "pid", "address", "healthy", "note")
    for row in rows:
        table.add_row(row.name, str(row.pid or ""), row.address, _mark(row.healthy), row.note)
    return table
