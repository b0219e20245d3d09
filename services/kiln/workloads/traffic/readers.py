"""Readers for the public LLM-serving traces: Azure LLM inference CSV, Mooncake JSONL and (in
:mod:`kiln.workloads.traffic.servegen`) ServeGen's request JSONL and per-client files.

- Azure: CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps read as UTC.
- Mooncake: JSON lines with ``timestamp`` (ms from the trace start), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512-token prefix block).

Malformed rows are skipped up to ``max_bad_fraction`` of the rows and at most ``max_bad_rows``,
returned in :attr:`Trace.problems` as ``(line, reason)`` with a ``trace_rows_skipped`` warning;
beyond that :class:`TraceError` names ``file:line``. Malformed, besides unparsable fields:

- a Mooncake row whose ``hash_ids`` count is not ``ceil(input_length / 512)``;
- a row with 0 input tokens (a request has at least one prompt token);
- a negative Mooncake timestamp, or any row earlier than the file's first row: the first row is
  the trace's start, so one stray row cannot move the origin and stretch the span.

Rows later than the first but out of order are sorted into place (counted in
:attr:`Trace.reordered`, ``trace_rows_reordered`` warning). Rows with 0 output tokens are kept
(prefill-only requests) and counted in :attr:`Trace.zero_output` (``trace_zero_output_rows``
warning). A directory, or any path that is not a regular file, is a TraceError; a missing file
is FileNotFoundError.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any, TextIO

import structlog

from kiln.workloads.traffic.prefix import MOONCAKE_BLOCK_TOKENS
from kiln.workloads.traffic.records import Request, RowProblem, Trace

log = structlog.get_logger(__name__)

DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_MAX_BAD_ROWS = 100
AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
AZURE_FORMAT = "azure_csv"
MOONCAKE_FORMAT = "mooncake_jsonl"
_SHOWN = 5

# (whole epoch seconds, fraction of a second, isl, osl, hash_ids, line): arrival kept in two parts
# so wall-clock timestamps near 1.7e9 s keep their 100 ns digits until the trace start is removed.
_Row = tuple[int, float, int, int, tuple[int, ...], int]


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


class RowError(Exception):
    """One row is malformed; the argument is the reason (caught by the readers, never raised to
    their callers).
    """


# ---------------------------------------------------------------------------- public readers
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
    with open_trace(p, newline="") as f:
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
                    raise RowError(f"expected {width} fields, got {len(fields)}")
                t, c, g = (fields[i] for i in columns)
                whole, frac = _wall_clock(t)
                isl = nonzero_input(_count(c, "ContextTokens"), "ContextTokens")
                rows.append((whole, frac, isl, _count(g, "GeneratedTokens"), (), line))
            except RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    break
    return finish(p, AZURE_FORMAT, rows, problems, max_bad_fraction, max_bad_rows)


def read_mooncake_jsonl(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read a Mooncake trace (other keys ignored); TraceError: no requests or too many malformed
    rows (a ``hash_ids`` count other than ``ceil(input_length / 512)`` among them).
    """
    p = Path(path)
    rows: list[_Row] = []
    problems: list[RowProblem] = []
    with open_trace(p) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rows.append(_mooncake_row(text, line))
            except RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    break
    return finish(p, MOONCAKE_FORMAT, rows, problems, max_bad_fraction, max_bad_rows)


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
        raise RowError(f"unparsable time {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp()), frac


def _count(text: str, name: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise RowError(f"bad number in {name}: {text!r}") from None
    if value < 0:
        raise RowError(f"negative {name}: {value}")
    return value


def timed_json_row(text: str, unit: str, since: str) -> tuple[dict[str, Any], float]:
    """A JSONL row's object and its ``timestamp`` (a finite, non-negative number in ``unit``
    from ``since``; the error messages name both).

    Raises:
        RowError: not JSON, not an object, or a missing, unparsable or negative timestamp.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise RowError(f"expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise RowError("missing field 'timestamp'")
    t = obj["timestamp"]
    if type(t) not in (int, float) or not math.isfinite(t):
        raise RowError(f"unparsable time {t!r} (expected {unit})")
    if t < 0:
        raise RowError(f"negative timestamp {t} ({unit} from {since})")
    return obj, float(t)


def json_count(obj: dict[str, Any], name: str) -> int:
    if name not in obj:
        raise RowError(f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise RowError(f"bad number in {name}: {value!r}")
    if value < 0:
        raise RowError(f"negative {name}: {value}")
    return value


def nonzero_input(isl: int, name: str) -> int:
    """``isl``; RowError when it is 0 (a request has at least one prompt token)."""
    if isl == 0:
        raise RowError(f"{name} 0: a request has at least one prompt token")
    return isl


def arrival_parts(seconds: float) -> tuple[int, float]:
    """(whole seconds, fraction) of a finite arrival time."""
    whole = math.floor(seconds)
    return whole, seconds - whole


def _mooncake_row(text: str, line: int) -> _Row:
    obj, ms = timed_json_row(text, "milliseconds", "the trace start")
    isl = nonzero_input(json_count(obj, "input_length"), "input_length")
    osl = json_count(obj, "output_length")
    if "hash_ids" not in obj:
        raise RowError("missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        raise RowError("hash_ids must be a list of integers")
    blocks = -(-isl // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise RowError(
            f"{len(ids)} hash_ids for input_length {isl} (expected ceil({isl} / "
            f"{MOONCAKE_BLOCK_TOKENS}) = {blocks})"
        )
    whole, frac = arrival_parts(ms / 1000)
    return whole, frac, isl, osl, tuple(ids), line


# ---------------------------------------------------------------------------- assembling
def check_problems(
    path: Path,
    problems: list[RowProblem],
    total: int,
    max_bad_fraction: float,
    max_bad_rows: int,
    *,
    stopped: bool,
) -> None:
    """TraceError when more of ``total`` rows are malformed than may be skipped (``stopped``:
    reading gave up after ``max_bad_rows``); else a ``trace_rows_skipped`` warning if any were.
    """
    allowed = min(max_bad_rows, int(max_bad_fraction * total))
    if len(problems) > allowed:
        count = f"more than {max_bad_rows}" if stopped else str(len(problems))
        of = f"the first {total} rows read" if stopped else f"{total} rows"
        raise TraceError(
            f"{path}: {count} malformed rows in {of} (at most {allowed} may be skipped): "
            + _listing(path, problems),
            path,
            tuple(problems),
        )
    if problems:
        log.warning(
            "trace_rows_skipped",
            file=str(path),
            skipped=len(problems),
            rows=total,
            first=[f"{path}:{p.line}: {p.reason}" for p in problems[:_SHOWN]],
        )


def warn_zero_output(path: Path, lines: list[int], rows: int) -> int:
    """Log ``trace_zero_output_rows`` for the rows (``lines``) kept with 0 output tokens; their
    count.
    """
    if lines:
        log.warning(
            "trace_zero_output_rows",
            file=str(path),
            kept=len(lines),
            rows=rows,
            first=[f"{path}:{line}" for line in lines[:_SHOWN]],
            policy="kept as prefill-only requests",
        )
    return len(lines)


def finish(
    path: Path,
    fmt: str,
    rows: list[_Row],
    problems: list[RowProblem],
    max_bad_fraction: float,
    max_bad_rows: int,
) -> Trace:
    """The Trace of parsed ``rows`` (file order) and the malformed rows found: rows earlier than
    the first row are malformed too; TraceError past the skip threshold or with no rows left.
    """
    stopped = len(problems) > max_bad_rows
    total = len(rows) + len(problems)
    if rows:
        start, start_line = rows[0][:2], rows[0][5]
        early = [r for r in rows if r[:2] < start]
        for r in early:
            before = (start[0] - r[0]) + (start[1] - r[1])
            problems.append(
                RowProblem(
                    r[5],
                    f"arrival {before:.6g} s before the first row (line {start_line}), which "
                    "starts the trace",
                )
            )
        if early:
            rows = [r for r in rows if r[:2] >= start]
            problems.sort(key=lambda p: p.line)
    check_problems(path, problems, total, max_bad_fraction, max_bad_rows, stopped=stopped)
    if not rows:
        raise TraceError(f"{path}: no requests in the file", path, tuple(problems))
    reordered = sum(1 for a, b in pairwise(rows) if b[:2] < a[:2])
    if reordered:
        rows.sort(key=lambda r: (r[0], r[1]))
        log.warning("trace_rows_reordered", file=str(path), reordered=reordered, rows=len(rows))
    zero_output = warn_zero_output(path, [r[5] for r in rows if r[3] == 0], len(rows))
    base_whole, base_frac = rows[0][0], rows[0][1]
    requests = tuple(
        Request((whole - base_whole) + (frac - base_frac), isl, osl, ids)
        for whole, frac, isl, osl, ids, _ in rows
    )
    return Trace(path, fmt, requests, tuple(problems), reordered, zero_output)


def _listing(path: Path, problems: list[RowProblem]) -> str:
    shown = "; ".join(f"{path}:{p.line}: {p.reason}" for p in problems[:_SHOWN])
    more = len(problems) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def open_trace(path: Path, newline: str | None = None) -> TextIO:
    """``path`` opened as text (undecodable bytes replaced); TraceError for a directory or
    anything else that is not a regular file, FileNotFoundError when nothing is there.
    """
    if path.is_dir():
        raise TraceError(
            f"{path}: is a directory, not a trace file (give one Azure CSV, Mooncake JSONL or "
            "ServeGen file)",
            path,
        )
    if path.exists() and not path.is_file():
        raise TraceError(f"{path}: not a regular file, not a trace file", path)
    return path.open(encoding="utf-8", errors="replace", newline=newline)


def first_line(path: Path) -> str:
    """The first non-blank line of the file (stripped), or "" when there is none."""
    with open_trace(path) as f:
        lines: Iterator[str] = (line.strip() for line in f)
        return next((line for line in lines if line), "")
