"""Trace rows that used to be taken silently (issue 17): hash-id counts, zero lengths, times
before the trace's start, a directory as a trace. Each is refused with its line or kept under a
policy that warns and is counted (docs/design/bounds.md, "Trace and checkpoint files")."""

from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.workloads.traffic import TraceError, read_trace

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
LLAMA = DATA / "models" / "llama-3.2-1b.json"


def _mooncake(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mc(ms: float, isl: int = 600, osl: int = 5, ids: list[int] | None = None) -> dict[str, object]:
    blocks = list(range(math.ceil(isl / 512))) if ids is None else ids
    return {"timestamp": ms, "input_length": isl, "output_length": osl, "hash_ids": blocks}


def _azure(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    """Rows of (seconds after 18:00, context tokens, generated tokens)."""
    start = datetime(2023, 11, 16, 18)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"{start + timedelta(seconds=s):%Y-%m-%d %H:%M:%S.%f},{c},{g}" for s, c, g in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _warnings(logs: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning" and e["event"] == event]


# ---------------------------------------------------------------------------- hash_ids
@pytest.mark.parametrize(("isl", "count"), [(6755, 20), (512, 2), (7234, 1), (1, 0), (513, 1)])
def test_a_hash_id_count_other_than_one_per_block_is_refused_with_its_line(
    tmp_path: Path, isl: int, count: int
) -> None:
    rows = [_mc(0), _mc(1000, isl, ids=list(range(100, 100 + count))), _mc(2000)]
    path = _mooncake(tmp_path / "m.jsonl", rows)
    expected = math.ceil(isl / 512)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:2: {count} hash_ids for input_length {isl}" in str(err.value)
    assert f"= {expected})" in str(err.value)
    with capture_logs() as logs:
        trace = read_trace(path, max_bad_fraction=1.0)
    assert len(trace.requests) == 2 and [p.line for p in trace.problems] == [2]
    assert _warnings(logs, "trace_rows_skipped")


def test_one_id_per_started_block_is_accepted(tmp_path: Path) -> None:
    rows = [_mc(0, 6755), _mc(1, 512), _mc(2, 7234), _mc(3, 513)]
    trace = read_trace(_mooncake(tmp_path / "m.jsonl", rows))
    assert [len(r.hash_ids) for r in trace.requests] == [14, 1, 15, 2] and trace.problems == ()


# ---------------------------------------------------------------------------- zero lengths
def test_zero_input_is_a_malformed_row_in_both_formats(tmp_path: Path) -> None:
    m = _mooncake(tmp_path / "m.jsonl", [_mc(0), _mc(5, 0, ids=[]), _mc(10)])
    with pytest.raises(TraceError, match=r"m\.jsonl:2: input_length 0: a request has at least"):
        read_trace(m)
    a = _azure(tmp_path / "a.csv", [(0, 10, 5), (1, 0, 5), (2, 10, 5)])
    with pytest.raises(TraceError, match=r"a\.csv:3: ContextTokens 0"):
        read_trace(a)
    assert [p.line for p in read_trace(a, max_bad_fraction=1.0).problems] == [3]


def test_zero_output_rows_are_kept_counted_and_warned(tmp_path: Path) -> None:
    m = _mooncake(tmp_path / "m.jsonl", [_mc(0), _mc(5, osl=0), _mc(10, osl=0)])
    a = _azure(tmp_path / "a.csv", [(0, 10, 0), (1, 10, 5)])
    for path, kept, first in ((m, 2, ":2"), (a, 1, ":2")):
        with capture_logs() as logs:
            trace = read_trace(path)
        assert trace.zero_output == kept and trace.problems == ()
        assert sum(r.osl == 0 for r in trace.requests) == kept
        (warning,) = _warnings(logs, "trace_zero_output_rows")
        assert warning["kept"] == kept and str(warning["first"][0]).endswith(first)


# ---------------------------------------------------------------------------- time
def test_a_negative_mooncake_timestamp_is_refused(tmp_path: Path) -> None:
    path = _mooncake(tmp_path / "m.jsonl", [_mc(0), _mc(-7000), _mc(1000)])
    with pytest.raises(TraceError, match=r"m\.jsonl:2: negative timestamp -7000"):
        read_trace(path)


def test_a_row_before_the_first_cannot_stretch_the_span(tmp_path: Path) -> None:
    # 200 rows over 199.9 s and one 7 s before the first: the span stays 199.9 s.
    rows = [(100 + i * 199.9 / 199, 10, 5) for i in range(200)]
    rows.insert(57, (93.0, 10, 5))
    path = _azure(tmp_path / "a.csv", rows)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:59: arrival 7 s before the first row (line 2)" in str(err.value)
    with capture_logs() as logs:
        trace = read_trace(path, max_bad_fraction=1.0)
    assert trace.requests[-1].arrival_s == pytest.approx(199.9)
    assert len(trace.requests) == 200 and [p.line for p in trace.problems] == [59]
    assert _warnings(logs, "trace_rows_skipped")


def test_rows_after_the_start_but_out_of_order_are_still_sorted(tmp_path: Path) -> None:
    path = _mooncake(tmp_path / "m.jsonl", [_mc(1000), _mc(3000), _mc(2000), _mc(1000)])
    trace = read_trace(path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.0, 1.0, 2.0]
    assert trace.reordered == 2 and trace.problems == ()


# ---------------------------------------------------------------------------- a directory
def test_a_directory_is_one_clear_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="is a directory, not a trace file") as err:
        read_trace(tmp_path)
    assert "Errno" not in str(err.value) and "\n" not in str(err.value)
    named = tmp_path / "chunk-3-trace.csv"  # named like a ServeGen file, still a directory
    named.mkdir()
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(named)
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "absent.csv")


@pytest.mark.skipif(not LLAMA.is_file(), reason="../shared/data is not here")
@pytest.mark.parametrize(
    "command",
    [
        ["compile", "--model", str(LLAMA), "--traffic", "{dir}"],
        ["plan", "--model", str(LLAMA), "--hardware", "h200", "--traffic", "{dir}"],
        ["traffic", "observe", "dep", "{dir}"],
    ],
)
def test_cli_names_a_directory_in_one_line(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens here and TLS is off: the trace error must come before any call.
    monkeypatch.setenv("KILN_AGENT_RUNNER_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("KILN_COST_MODEL_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("KILN_TLS", "off")
    args = [a.replace("{dir}", str(tmp_path)) for a in command]
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert lines == [f"error: {tmp_path}: is a directory, not a trace file " + _HINT]
    assert "Errno" not in result.output and "Traceback" not in result.output


_HINT = "(give one Azure CSV, Mooncake JSONL or ServeGen file)"
