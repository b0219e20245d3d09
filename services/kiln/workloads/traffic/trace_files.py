"""Which reader a trace file needs: :func:`read_trace` recognises Azure LLM CSV, Mooncake JSONL
and ServeGen files (:mod:`kiln.workloads.traffic.readers`, :mod:`kiln.workloads.traffic.servegen`)
by name, first line, else suffix."""

from __future__ import annotations

from pathlib import Path

from kiln.workloads.traffic import servegen
from kiln.workloads.traffic.readers import (
    DEFAULT_MAX_BAD_FRACTION,
    DEFAULT_MAX_BAD_ROWS,
    TraceError,
    first_line,
    read_azure_csv,
    read_mooncake_jsonl,
)
from kiln.workloads.traffic.records import Trace


def read_trace(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read an Azure CSV, a Mooncake JSONL or a ServeGen file, recognised by its name
    (ServeGen's ``chunk-<id>-trace.csv`` / ``-dataset.json``), its first line, else its suffix.
    TraceError (a directory, unknown format, empty, too many malformed rows) or OSError.
    """
    p = Path(path)
    if servegen.is_client_file(p):
        return servegen.read_servegen_client(
            p, max_bad_fraction=max_bad_fraction, max_bad_rows=max_bad_rows
        )
    first = first_line(p)
    suffix = p.suffix.lower()
    if first.startswith("{"):
        is_servegen = servegen.is_request_line(first)
        reader = servegen.read_servegen_requests if is_servegen else read_mooncake_jsonl
    elif servegen.is_window_line(first):
        reader = servegen.read_servegen_client
    elif first.split(",", 1)[0].strip().strip('"').lower() == "timestamp" or suffix == ".csv":
        reader = read_azure_csv
    elif suffix in (".jsonl", ".ndjson", ".json"):
        reader = read_mooncake_jsonl
    elif not first:
        raise TraceError(f"{p}: empty file, no requests", p)
    else:
        raise TraceError(
            f"{p}: unknown trace format (expected an Azure LLM CSV with a TIMESTAMP header, "
            f"a Mooncake JSONL or a ServeGen file; first line {first[:80]!r})",
            p,
        )
    return reader(p, max_bad_fraction=max_bad_fraction, max_bad_rows=max_bad_rows)
