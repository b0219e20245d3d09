"""Readers for the public LLM-serving traces: Azure LLM inference CSV and Mooncake JSONL.

- Azure: CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps read as UTC.
- Mooncake: JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (512-token prefix-block ids).

Malformed rows are skipped up to ``max_bad_fraction`` of the rows and at most ``max_bad_rows``,
returned in :attr:`Trace.problems` as ``(line, reason)``; beyond that :class:`TraceError` names
``file:line``. Rows out of time order are sorted into place and counted.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import structlog

from kiln.workloads.traffic.records import Request, RowProblem, Trace

log = structlog.get_logger(__name__)

DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_MAX_BAD_ROWS = 100
AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
AZURE_FORMAT = "azure_csv"
MOONCAKE_FORMAT = "mooncake_jsonl"
_SHOWN = 5

# (whole epoch seconds, fraction of a second, isl, osl, hash_ids): arrival kept in two parts so
# wall-clock timestamps near 1.7e9 s keep their 100 ns digits until the trace start is removed.
_Row = tuple[int, float, int, int, tuple[int, ...]]


class TraceError(ValueError):
    """A trace that cannot be read (unknown format, no requests, too many malformed rows);
    ``problems`` holds every malformed row found.
    """

    def __init__(
        self, message: str, path: Path | None = None, problems: tuple[RowProblem, ...] = ()
    ) -> None:
        super().__init__(message)
        self.path = path
        self.problems = problems


class _RowError(Exception):
    """One row is malformed; the argument is the reason."""


# ---------------------------------------------------------------------------- public readers
def read_trace(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read an Azure CSV or a Mooncake JSONL trace, recognised by its first line, else by suffix.
    TraceError (unknown format, empty, too many malformed rows) or OSError.
    """
    p = Path(path)
    first = _first_line(p)
    suffix = p.suffix.lower()
    if first.startswith("{"):
        reader = read_mooncake_jsonl
    elif first.split(",", 1)[0].strip().strip('"').lower() == "timestamp" or suffix == ".csv":
        reader = read_azure_csv
    elif suffix in (".jsonl", ".ndjson", ".json"):
        reader = read_mooncake_jsonl
    elif not first:
        raise TraceError(f"{p}: empty file, no requests", p)
    else:
        raise TraceError(
            f"{p}: unknown trace format (expected an Azure LLM CSV with a TIMESTAMP header or "
            f"a Mooncake JSONL; first line {first[:80]!r})",
            p,
        )
    return reader(p, max_bad_fraction=max_bad_fraction, max_bad_rows=max_bad_rows)


def read_azure_csv(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read an Azure trace (columns by header name, any order); arrivals in seconds after the
    earliest. TraceError: no such header, no requests, too many malformed rows.
    """
    p = Path(path)
    rows: list[_Row] = []
    problems: list[RowProblem] = []
    with p.open(encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        columns: tuple[int, int, int] | None = None
        width = 0
        for fields in reader:
            line = reader.line_num
            if not fields or (len(fields) == 1 and not fields[0].strip()):
                continue  # blank line
            if columns is None:
                columns = _azure_columns(p, line, fields)
                width = len(fields)
                continue
            try:
                if len(fields) != width:
                    raise _RowError(f"expected {width} fields, got {len(fields)}")
                t, c, g = (fields[i] for i in columns)
                whole, frac = _wall_clock(t)
                rows.append(
                    (whole, frac, _count(c, "ContextTokens"), _count(g, "GeneratedTokens"), ())
                )
            except _RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    break
    return _finish(p, AZURE_FORMAT, rows, problems, max_bad_fraction, max_bad_rows)


def read_mooncake_jsonl(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read a Mooncake trace (other keys ignored); TraceError: no requests or too many malformed
    rows.
    """
    p = Path(path)
    rows: list[_Row] = []
    problems: list[RowProblem] = []
    with p.open(encoding="utf-8", errors="replace") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rows.append(_mooncake_row(text))
            except _RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    break
    return _finish(p, MOONCAKE_FORMAT, rows, problems, max_bad_fraction, max_bad_rows)


# ---------------------------------------------------------------------------- row parsing
def _azure_columns(path: Path, line: int, header: list[str]) -> tuple[int, int, int]:
    names = [h.strip().lower() for h in header]
    try:
        return (
            names.index(AZURE_COLUMNS[0]),
            names.index(AZURE_COLUMNS[1]),
            names.index(AZURE_COLUMNS[2]),
        )
    except ValueError:
        raise TraceError(
            f"{path}:{line}: not an Azure LLM trace header (expected "
            f"TIMESTAMP,ContextTokens,GeneratedTokens; got {','.join(header)[:80]!r})",
            path,
        ) from None


def _wall_clock(text: str) -> tuple[int, float]:
    """(whole Unix seconds, fraction) of an ISO-8601 time, naive as UTC, keeping every fractional
    digit.
    """
    s = text.strip()
    head, dot, digits = s.partition(".")
    try:
        if dot and digits.isascii() and digits.isdigit():
            dt = datetime.fromisoformat(head)
            frac = int(digits) / 10 ** len(digits)
        else:
            dt = datetime.fromisoformat(s)
            frac = dt.microsecond / 1e6
            dt = dt.replace(microsecond=0)
    except ValueError:
        raise _RowError(f"unparsable time {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp()), frac


def _count(text: str, name: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise _RowError(f"bad number in {name}: {text!r}") from None
    if value < 0:
        raise _RowError(f"negative {name}: {value}")
    return value


def _json_count(obj: dict[str, Any], name: str) -> int:
    if name not in obj:
        raise _RowError(f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise _RowError(f"bad number in {name}: {value!r}")
    if value < 0:
        raise _RowError(f"negative {name}: {value}")
    return value


def _mooncake_row(text: str) -> _Row:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _RowError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _RowError(f"expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise _RowError("missing field 'timestamp'")
    ms = obj["timestamp"]
    if type(ms) not in (int, float) or not math.isfinite(ms):
        raise _RowError(f"unparsable time {ms!r} (expected milliseconds)")
    isl = _json_count(obj, "input_length")
    osl = _json_count(obj, "output_length")
    if "hash_ids" not in obj:
        raise _RowError("missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        raise _RowError("hash_ids must be a list of integers")
    whole = math.floor(ms / 1000)
    return whole, ms / 1000 - whole, isl, osl, tuple(ids)


# ---------------------------------------------------------------------------- assembling
def _finish(
    path: Path,
    fmt: str,
    rows: list[_Row],
    problems: list[RowProblem],
    max_bad_fraction: float,
    max_bad_rows: int,
) -> Trace:
    total = len(rows) + len(problems)
    allowed = min(max_bad_rows, int(max_bad_fraction * total))
    if len(problems) > allowed:
        stopped = len(problems) > max_bad_rows
        count = f"more than {max_bad_rows}" if stopped else str(len(problems))
        of = f"the first {total} rows read" if stopped else f"{total} rows"
        raise TraceError(
            f"{path}: {count} malformed rows in {of} (at most {allowed} may be skipped): "
            + _listing(path, problems),
            path,
            tuple(problems),
        )
    if not rows:
        raise TraceError(f"{path}: no requests in the file", path, tuple(problems))
    if problems:
        log.warning(
            "trace_rows_skipped",
            file=str(path),
            skipped=len(problems),
            rows=total,
            first=[f"{path}:{p.line}: {p.reason}" for p in problems[:_SHOWN]],
        )
    reordered = sum(1 for a, b in pairwise(rows) if b[:2] < a[:2])
    if reordered:
        rows.sort(key=lambda r: (r[0], r[1]))
        log.warning("trace_rows_reordered", file=str(path), reordered=reordered, rows=len(rows))
    base_whole, base_frac = rows[0][0], rows[0][1]
    requests = tuple(
        Request((whole - base_whole) + (frac - base_frac), isl, osl, ids)
        for whole, frac, isl, osl, ids in rows
    )
    return Trace(path, fmt, requests, tuple(problems), reordered)


def _listing(path: Path, problems: list[RowProblem]) -> str:
    shown = "; ".join(f"{path}:{p.line}: {p.reason}" for p in problems[:_SHOWN])
    more = len(problems) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def _first_line(path: Path) -> str:
    """The first non-blank line of the file (stripped), or "" when there is none."""
    with path.open(encoding="utf-8", errors="replace") as f:
        lines: Iterator[str] = (line.strip() for line in f)
        return next((line for line in lines if line), "")
