"""ServeGen's public formats (github.com/alibaba/ServeGen): request records as JSON lines and a
client's ``chunk-<id>-trace.csv`` / ``chunk-<id>-dataset.json``, on small synthetic files."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kiln.workloads.traffic import (
    TraceError,
    TrafficShape,
    read_servegen_client,
    read_servegen_requests,
    read_trace,
)


def _requests(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _req(t: float, isl: int = 300, osl: int = 40, i: int = 0) -> dict[str, object]:
    return {"request_id": i, "timestamp": t, "data": {"input_tokens": isl, "output_tokens": osl}}


def _client(
    root: Path,
    windows: list[str],
    dataset: dict[str, dict[str, str]],
    cid: int = 7,
) -> Path:
    """A client's two files as clientpool.py reads them; returns the trace CSV."""
    trace = root / f"chunk-{cid}-trace.csv"
    trace.write_text("\n".join(windows) + "\n")
    (root / f"chunk-{cid}-dataset.json").write_text(json.dumps(dataset, indent=2))
    return trace


LENGTHS = {
    "0": {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{10: 0.5, 30: 0.5}"},
    "1200": {"input_tokens": "{1000: 1.0}", "output_tokens": "{7: 1.0}"},
}
WINDOWS = [
    "0,0.5,1.0,Gamma,1.0,2.0",
    "600,0,0,,0,0",  # idle
    "1200,0.1,1.3,Weibull,0.8,9.0",
]


# ---------------------------------------------------------------------------- request JSONL
def test_request_records_are_read_and_recognised(tmp_path: Path) -> None:
    path = _requests(tmp_path / "w.jsonl", [_req(0.25, i=0), _req(1.75, 900, 0, i=1)])
    trace = read_trace(path)
    assert trace.format == "servegen_requests_jsonl"
    assert [(r.arrival_s, r.isl, r.osl, r.hash_ids) for r in trace.requests] == [
        (0.0, 300, 40, ()),
        (1.5, 900, 0, ()),
    ]
    assert trace.zero_output == 1


def test_multimodal_input_is_text_plus_every_item(tmp_path: Path) -> None:
    data = {
        "text_tokens": 50,
        "image_tokens": [700, 300],
        "audio_tokens": [],
        "video_tokens": [5],
        "output_tokens": 9,
    }
    reason = {"input_tokens": 20, "output_tokens": 800, "reason_ratio": 0.75}
    rows = [{"timestamp": 0, "data": data}, {"timestamp": 2, "data": reason}]
    trace = read_servegen_requests(_requests(tmp_path / "mm.jsonl", rows))
    assert [(r.isl, r.osl) for r in trace.requests] == [(1055, 9), (20, 800)]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"timestamp": -1.0, "data": {"input_tokens": 3, "output_tokens": 1}}, "negative"),
        ({"timestamp": 1.0, "data": {"input_tokens": 0, "output_tokens": 1}}, "input tokens 0"),
        ({"timestamp": 1.0, "data": {"output_tokens": 1}}, "neither 'input_tokens'"),
        ({"timestamp": 1.0, "data": {"input_tokens": 3}}, "missing field 'output_tokens'"),
        ({"timestamp": 1.0, "data": {"text_tokens": 3, "image_tokens": 4}}, "must be a list"),
        ({"timestamp": "x", "data": {"input_tokens": 3, "output_tokens": 1}}, "unparsable time"),
        ({"timestamp": 0.5, "data": {"input_tokens": 3, "output_tokens": 1}}, "before the first"),
    ],
)
def test_malformed_request_rows_name_their_line(
    tmp_path: Path, row: dict[str, object], reason: str
) -> None:
    path = _requests(tmp_path / "w.jsonl", [_req(0.75), row, _req(2.0)])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:2:" in str(err.value) and reason in str(err.value)
    trace = read_trace(path, max_bad_fraction=1.0)
    assert len(trace.requests) == 2 and [p.line for p in trace.problems] == [2]


# ---------------------------------------------------------------------------- client files
def test_a_client_is_drawn_deterministically_from_its_windows(tmp_path: Path) -> None:
    csv = _client(tmp_path, WINDOWS, LENGTHS)
    trace = read_trace(csv)
    assert trace.format == "servegen_client" and trace.problems == ()
    # 0.5/s for 600 s, idle, then 0.1/s for the last window (as long as the one before).
    assert len(trace.requests) == 300 + 60
    again = read_trace(tmp_path / "chunk-7-dataset.json")  # either file names the client
    assert again.requests == trace.requests
    other = read_servegen_client(csv, seed=1)
    assert other.requests != trace.requests and len(other.requests) == 360
    first = [r for r in trace.requests if r.arrival_s < 600]
    late = [r for r in trace.requests if r.isl == 1000]
    assert {(r.isl, r.osl) for r in first} == {(100, 10), (300, 30)}  # one draw sets both
    assert len(late) == 60 and {r.osl for r in late} == {7}
    assert min(r.arrival_s for r in late) >= 1200 - trace.requests[0].arrival_s - 1e-9
    assert trace.requests[0].arrival_s == 0.0


def test_a_window_uses_the_latest_distribution_at_or_before_it(tmp_path: Path) -> None:
    lengths = {**LENGTHS, "600": {"input_tokens": "{}", "output_tokens": "{}"}}
    windows = ["0,0.1,1,Gamma,1,1", "600,0.1,1,Gamma,1,1", "1200,0.1,1,Gamma,1,1"]
    trace = read_servegen_client(_client(tmp_path, windows, lengths))
    isl = [r.isl for r in trace.requests]
    assert len(isl) == 180 and isl.count(1000) == 60  # the empty 600 s window falls back to 0


def test_a_span_and_the_request_cap(tmp_path: Path) -> None:
    csv = _client(tmp_path, WINDOWS, LENGTHS)
    span = read_servegen_client(csv, start_s=300, end_s=1500)
    assert len(span.requests) == 150 + 30
    with pytest.raises(TraceError, match=r"give 360 requests, more than 100; read a shorter"):
        read_servegen_client(csv, max_requests=100)


def test_arrival_gaps_follow_the_pattern(tmp_path: Path) -> None:
    # Gamma shape 0.05 is far burstier than Poisson (CV = 1/sqrt(0.05) = 4.5), shape 1 is Poisson.
    for shape, low, high in ((0.05, 2.5, 8.0), (1.0, 0.8, 1.2)):
        root = tmp_path / str(shape)
        root.mkdir()
        csv = _client(root, [f"0,5.0,1,Gamma,{shape},1.0", "3600,0,0,,0,0"], LENGTHS)
        times = [r.arrival_s for r in read_servegen_client(csv).requests]
        gaps = [b - a for a, b in pairwise(times)]
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert low < cv < high, (shape, cv)


def test_zero_lengths_drawn_from_a_client(tmp_path: Path) -> None:
    lengths = {"0": {"input_tokens": "{0: 0.25, 50: 0.75}", "output_tokens": "{0: 0.25, 5: 0.75}"}}
    csv = _client(tmp_path, ["0,1.0,1,Gamma,1,1", "600,0,0,,0,0"], lengths)
    with capture_logs() as logs:
        trace = read_servegen_client(csv)
    # One uniform draw sets both lengths, so the requests with 0 input are those with 0 output.
    dropped = 600 - len(trace.requests)
    assert 100 < dropped < 200 and trace.zero_output == 0
    assert [p.line for p in trace.problems] == [1]
    assert trace.problems[0].reason.startswith(f"{dropped} of 600 drawn requests had 0 input")
    assert any(e["event"] == "trace_rows_skipped" for e in logs)


def test_multimodal_and_reasoning_clients(tmp_path: Path) -> None:
    mm = {
        "0": {
            "text_tokens": "{10: 1.0}",
            "image_tokens": "{500: 1.0}",
            "audio_tokens": "{0: 1.0}",
            "video_tokens": "{0: 1.0}",
            "image_count": "{2: 1.0}",
            "audio_count": "{0: 1.0}",
            "video_count": "{0: 1.0}",
            "output_tokens": "{20: 1.0}",
        }
    }
    trace = read_servegen_client(_client(tmp_path, ["0,0.1,1,Weibull,1,1"], mm, cid=1))
    assert {(r.isl, r.osl) for r in trace.requests} == {(1010, 20)}
    reason = {"0": {**LENGTHS["1200"], "reason_ratio": "{0.0: 0.5, 0.5: 0.5}"}}
    shape = TrafficShape.from_trace(
        read_servegen_client(_client(tmp_path, ["0,0.1,1,Gamma,1,1"], reason, cid=2))
    )
    assert shape.isl_tokens.p50 == 1000 and shape.prefix_hit_rate == 0.0


@pytest.mark.parametrize(
    ("windows", "message"),
    [
        (["0,1,1,Gamma,1,1", "0,1,1,Gamma,1,1"], "2: window start 0 s not after"),
        (["0,1,1,Poisson,1,1", "600,0,0,,0,0"], "1: unknown arrival pattern 'Poisson'"),
        (["0,-1,1,Gamma,1,1", "600,0,0,,0,0"], "1: rate must be a finite number >= 0"),
        (["0,1,1,Gamma,0,1", "600,0,0,,0,0"], "1: Gamma needs shape and scale > 0"),
        (["0,1,1,Gamma,1", "600,0,0,,0,0"], "1: expected 6 fields"),
    ],
)
def test_malformed_windows_name_their_line(
    tmp_path: Path, windows: list[str], message: str
) -> None:
    csv = _client(tmp_path, windows, LENGTHS)
    with pytest.raises(TraceError, match=f"chunk-7-trace.csv:{message}"):
        read_trace(csv)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ({"0": {"input_tokens": "{1: 0.5}", "output_tokens": "{1: 1.0}"}}, "sum to 0.5"),
        ({"0": {"input_tokens": "{1: 1.0}"}}, "no output_tokens"),
        ({"0": {"input_tokens": "__import__('os')", "output_tokens": "{1: 1}"}}, "dict literal"),
        ({"0": {"input_tokens": "{1.5: 1.0}", "output_tokens": "{1: 1}"}}, "integers >= 0"),
    ],
)
def test_malformed_distributions_name_their_window(
    tmp_path: Path, lengths: dict[str, dict[str, str]], message: str
) -> None:
    csv = _client(tmp_path, WINDOWS, lengths)
    with pytest.raises(TraceError, match=f"window '0': .*{message}"):
        read_trace(csv)


def test_a_window_without_any_distribution_is_a_malformed_row(tmp_path: Path) -> None:
    csv = _client(tmp_path, WINDOWS, {"1200": LENGTHS["1200"]})
    with pytest.raises(TraceError, match=r"chunk-7-trace.csv:1: no length distribution"):
        read_trace(csv)


def test_a_window_csv_is_recognised_by_content_and_needs_its_dataset(tmp_path: Path) -> None:
    alone = tmp_path / "client.csv"
    alone.write_text("\n".join(WINDOWS) + "\n")
    with pytest.raises(TraceError, match=r"client\.csv: a ServeGen client is read from"):
        read_trace(alone)
    named = tmp_path / "chunk-4-trace.csv"
    named.write_text("\n".join(WINDOWS) + "\n")
    with pytest.raises(TraceError, match=r"chunk-4-dataset\.json: missing"):
        read_trace(named)
