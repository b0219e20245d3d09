"""How the CLI shows things: rich tables for people, JSON lines for programs."""

from __future__ import annotations

import json
import re
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
        "principal": event.metadata.principal,
        "correlation_id": event.metadata.correlation_id,
        "causation_id": event.metadata.causation_id,
        "recorded_at": recorded_at(event),
        "data": event_data(event),
    }


def _cut(text: str, width: int = DATA_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def event_cells(event: Any) -> list[str]:
    """The table cells of one event (time to the second, data cut to ``DATA_WIDTH``)."""
    at = recorded_at(event)
    return [
        str(event.position),
        event.stream_id,
        str(event.stream_version),
        event.type,
        event.metadata.team,
        at[:19].replace("T", " "),
        _cut(compact_json(event_data(event))),
    ]


def events_table(events: Iterable[Any], title: str | None = None) -> Table:
    """A table of events, one row each; the data column is cut to fit the terminal."""
    table = Table(title=title, title_justify="left")
    for name in ("pos", "stream", "ver", "type", "team", "recorded_at (UTC)"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("pos", "ver") else "left")
    table.add_column("data")  # the one column that gives up width on a narrow terminal
    for event in events:
        *fixed, data = event_cells(event)
        table.add_row(*fixed, Text(data, no_wrap=True, overflow="ellipsis"))
    return table


NARROW = 110
"""Below this many columns, events print one per line instead of as a table."""


def print_events(events: Sequence[Any], title: str) -> None:
    """Print events as a table, or one line each on a narrow terminal."""
    if not events:
        console.print(f"{title} (none yet)", markup=False)
        return
    if console.width >= NARROW:
        console.print(events_table(events, title=title))
        return
    console.print(title, style="bold", markup=False)
    for event in events:
        console.print(event_line(event), no_wrap=True, overflow="ellipsis")


def event_line(event: Any) -> Text:
    """One event on one line (``kiln ledger tail --follow``); print it with ``no_wrap``."""
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


MAIN_COLUMNS: dict[str, tuple[str, ...]] = {
    "compilations": (
        "compilation_id",
        "status",
        "model_name",
        "hardware",
        "experiments_done",
        "best_tokens_per_s",
        "speedup",
        "team",
        "failures",
        "updated_at",
    ),
    "experiments": (
        "experiment_id",
        "status",
        "tier",
        "tokens_per_s",
        "median_ms",
        "correct",
        "compilation_id",
        "candidate_id",
        "agent",
        "completed_at",
    ),
    "best-candidates": (
        "workload_key",
        "candidate_id",
        "tokens_per_s",
        "speedup",
        "tier",
        "compilation_id",
        "found_at",
    ),
}
"""The columns ``kiln ledger query`` shows people, per projection, most important first (on a
narrow terminal the last ones are left out); ``--json`` shows every column."""

MAX_COLUMNS = 10
"""Columns shown for a projection without a :data:`MAIN_COLUMNS` entry."""


def rows_table(
    rows: Sequence[dict[str, Any]],
    projection: str,
    title: str | None = None,
    width: int | None = None,
) -> tuple[Table, list[str]]:
    """Projection rows as one table, a row per result.

    The columns are the projection's main ones (:data:`MAIN_COLUMNS`, those present), else
    the first :data:`MAX_COLUMNS` in order of appearance; with ``width`` (the terminal's),
    trailing columns are left out until every cell fits unwrapped (at least one column
    stays). Returns the table and the names of the columns left out.
    """
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    main = [c for c in MAIN_COLUMNS.get(projection, ()) if c in columns]
    shown = main or columns[:MAX_COLUMNS]
    cells = {c: [_cell(row.get(c)) for row in rows] for c in shown}
    if width is not None:
        need = {c: max([len(c), *(len(v) for v in cells[c])]) + 3 for c in shown}
        while len(shown) > 1 and sum(need[c] for c in shown) + 1 > width:
            shown = shown[:-1]
    hidden = [c for c in columns if c not in shown]
    table = Table(title=title, title_justify="left")
    for name in shown:
        numeric = all(r.get(name) is None or type(r.get(name)) in (int, float) for r in rows)
        table.add_column(name, no_wrap=True, justify="right" if numeric else "left")
    for i in range(len(rows)):
        table.add_row(*(cells[c][i] for c in shown))
    return table, hidden


_TIMESTAMP_RE = re.compile(r"^(\d{4}-\d\d-\d\d)T(\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]00:?00)?$")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return _cut(compact_json(value), 60)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    if isinstance(value, str):
        match = _TIMESTAMP_RE.match(value)
        if match:  # a UTC timestamp, to the second
            return f"{match.group(1)} {match.group(2)}"
        return _cut(value, 60)
    return str(value)


def _mark(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("no", style="red")


def replay_table(response: Any) -> Table:
    """A table of a ReplayResponse: per projection, rows live/rebuilt, whether equal, and
    whether the rebuilt rows replaced the live ones ("yes"; "no" for a difference left as it
    was; "not needed" when equal)."""
    table = Table("projection", "rows live", "rows rebuilt", "equal", "applied")
    for proj in response.projections:
        if proj.applied:
            applied = Text("yes", style="green")
        elif proj.equal:
            applied = Text("not needed", style="dim")
        else:
            applied = Text("no", style="red")
        table.add_row(
            proj.name, str(proj.rows_live), str(proj.rows_rebuilt), _mark(proj.equal), applied
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
    table.columns[2].overflow = "fold"
    for row in rows:
        table.add_row(row.name, str(row.pid or ""), row.address, _mark(row.healthy), row.note)
    return table
