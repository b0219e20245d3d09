"""Traffic shapes from the real traces in ../shared/data/traces, checked against SOURCES.md, and
the readers' handling of malformed files on small synthetic ones."""

from __future__ import annotations

import json
import math
import random
import statistics
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kiln.workloads.traffic import (
    Distribution,
    Request,
    ServiceModel,
    TraceError,
    TrafficShape,
    block_reuse_rate,
    estimate_concurrency,
    operating_batch_size,
    operating_context_len,
    percentile,
    prefix_hit_rate,
    read_azure_csv,
    read_mooncake_jsonl,
    read_trace,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/traces is not here")

# SOURCES.md's summary table: (value as published, decimals it was rounded to).
# rows, in mean/p50/p90/p99, out mean/p50/p90/p99, span s, mean rps, CV, token-weighted prefix
# proxy (fraction), blocks seen before (fraction).
P = tuple[float, int]
SOURCES: dict[str, dict[str, P]] = {
    "azure_llm_2023_code.csv": {
        "rows": (8819, 0),
        "in_mean": (2048, 0),
        "in_p50": (1469, 0),
        "in_p90": (5188, 0),
        "in_p99": (7436, 0),
        "out_mean": (27.9, 1),
        "out_p50": (13, 0),
        "out_p90": (55, 0),
        "out_p99": (251, 0),
        "span": (3436, 0),
        "rps": (2.57, 2),
        "cv": (13.2, 1),
    },
    "azure_llm_2023_conv.csv": {
        "rows": (19366, 0),
        "in_mean": (1155, 0),
        "in_p50": (1020, 0),
        "in_p90": (2735, 0),
        "in_p99": (4142, 0),
        "out_mean": (211.1, 1),
        "out_p50": (129, 0),
        "out_p90": (424, 0),
        "out_p99": (601, 0),
        "span": (3502, 0),
        "rps": (5.53, 2),
        "cv": (1.09, 2),
    },
    "mooncake_fast25_conversation.jsonl": {
        "rows": (12031, 0),
        "in_mean": (12035, 0),
        "in_p50": (6909, 0),
        "in_p90": (27367, 0),
        "in_p99": (85400, 0),
        "out_mean": (342.6, 1),
        "out_p50": (350, 0),
        "out_p90": (597, 0),
        "out_p99": (1119, 0),
        "span": (3537, 0),
        "rps": (3.40, 2),
        "cv": (3.03, 2),
        "prefix": (0.374, 3),
        "blocks": (0.366, 3),
    },
    "mooncake_fast25_synthetic.jsonl": {
        "rows": (3993, 0),
        "in_mean": (15325, 0),
        "in_p50": (11587, 0),
        "in_p90": (38611, 0),
        "in_p99": (66456, 0),
        "out_mean": (149.1, 1),
        "out_p50": (69, 0),
        "out_p90": (389, 0),
        "out_p99": (768, 0),
        "span": (1022, 0),
        "rps": (3.91, 2),
        "cv": (1.01, 2),
        "prefix": (0.651, 3),
        "blocks": (0.640, 3),
    },
}


def assert_rounds_to(name: str, actual: float, published: P) -> None:
    value, decimals = published
    # Published figures are rounded to `decimals`; allow that half-unit (and float noise).
    assert abs(actual - value) <= 0.5 * 10.0**-decimals + 1e-9, f"{name}: {actual} vs {value}"


def _dist_fields(prefix: str, d: Distribution) -> dict[str, float]:
    return {
        f"{prefix}_mean": d.mean,
        f"{prefix}_p50": d.p50,
        f"{prefix}_p90": d.p90,
        f"{prefix}_p99": d.p99,
    }


# ---------------------------------------------------------------------------- the real traces
@needs_traces
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_real_trace_matches_sources_md(name: str) -> None:
    published = SOURCES[name]
    trace = read_trace(TRACES / name)
    shape = TrafficShape.from_trace(trace)
    assert trace.problems == () and trace.reordered == 0
    times = [r.arrival_s for r in trace.requests]
    actual: dict[str, float] = {
        "rows": len(trace.requests),
        **_dist_fields("in", shape.isl_tokens),
        **_dist_fields("out", shape.osl_tokens),
        "span": times[-1] - times[0],
        "rps": shape.arrival_rate_rps,
        "cv": shape.interarrival_cv,
    }
    if "prefix" in published:
        actual["prefix"] = shape.prefix_hit_rate
        actual["blocks"] = block_reuse_rate(trace.requests)
    else:
        assert shape.prefix_hit_rate == 0.0
        assert any("no prefix-block hash ids" in n for n in shape.notes)
    assert set(actual) == set(published)
    for key, value in published.items():
        assert_rounds_to(f"{name} {key}", actual[key], value)
    assert times[0] == 0.0 and times == sorted(times)


@needs_traces
def test_mooncake_blocks_cover_the_prompt() -> None:
    # SOURCES.md: all Mooncake rows have len(hash_ids) == ceil(input_length / 512).
    trace = read_mooncake_jsonl(TRACES / "mooncake_fast25_synthetic.jsonl")
    assert all(len(r.hash_ids) == math.ceil(r.isl / 512) for r in trace.requests)


@needs_traces
def test_azure_fractional_seconds_are_kept() -> None:
    # First rows of the code trace: 18:17:03.9799600 and 18:17:04.0319600.
    trace = read_azure_csv(TRACES / "azure_llm_2023_code.csv")
    assert trace.requests[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (trace.requests[0].isl, trace.requests[0].osl) == (4808, 10)


@needs_traces
def test_biggest_trace_reads_into_a_shape() -> None:
    trace = read_trace(TRACES / "mooncake_fast25_conversation.jsonl")
    shape = TrafficShape.from_trace(trace)
    assert len(trace.requests) > 1000 and shape.batch_size >= 1 and shape.context_len > 0


@needs_traces
def test_real_concurrency_sweep_agrees_with_littles_law() -> None:
    trace = read_trace(TRACES / "azure_llm_2023_conv.csv")
    model = ServiceModel()
    c = estimate_concurrency(trace.requests, model)
    total = math.fsum(model.duration_s(r.isl, r.osl) for r in trace.requests)
    assert c.mean == pytest.approx(total / c.window_s, rel=1e-9)
    assert c.mean == pytest.approx(c.littles_law, rel=0.02)
    assert c.max >= c.mean > 1.0


# ---------------------------------------------------------------------------- statistics
def test_percentile_is_numpy_linear() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([10, 20], 0.9) == pytest.approx(19.0)
    assert percentile([7], 0.99) == 7.0
    rng = random.Random(7)
    xs = sorted(rng.randint(0, 10_000) for _ in range(997))
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    for q in (10, 50, 90, 99):
        assert percentile(xs, q / 100) == pytest.approx(cuts[q - 1], abs=1e-9)
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_interarrival_cv_uses_population_std() -> None:
    # Gaps 1 s and 3 s: mean 2, population std 1 (numpy's default), so CV 0.5.
    shape = TrafficShape.from_requests([Request(0.0, 1, 1), Request(1.0, 1, 1), Request(4.0, 1, 1)])
    assert shape.interarrival_cv == pytest.approx(0.5)
    assert shape.arrival_rate_rps == pytest.approx(0.5)


def test_prefix_hit_rate_counts_only_a_leading_cached_prefix() -> None:
    reqs = [
        Request(0.0, 1000, 1, (1, 2)),
        Request(1.0, 1200, 1, (1, 2, 3)),  # 2 cached blocks = 1024 tokens
        Request(2.0, 1500, 1, (1, 9, 2)),  # 9 is new: reuse stops after block 1 = 512 tokens
        Request(3.0, 300, 1, (1,)),  # one block cached, but only 300 prompt tokens
    ]
    assert prefix_hit_rate(reqs) == pytest.approx((1024 + 512 + 300) / 4000)
    # Blocks seen before (anywhere, not just leading): 2 + 2 + 1 of 9.
    assert block_reuse_rate(reqs) == pytest.approx(5 / 9)


def test_concurrency_sweep_on_known_intervals() -> None:
    model = ServiceModel(prefill_tokens_per_s=1.0, tpot_s=1.0)
    # Durations isl + osl: [0, 10) and [5, 15); a zero-length request is never in flight.
    reqs = [Request(0.0, 0, 10), Request(5.0, 4, 6), Request(7.0, 0, 0)]
    c = estimate_concurrency(reqs, model)
    assert c.window_s == 15.0
    assert c.mean == pytest.approx(20.0 / 15.0)
    assert c.max == 2
    # Back to back: one ends as the next arrives, so never two at once.
    assert estimate_concurrency([Request(0.0, 0, 5), Request(5.0, 0, 5)], model).max == 1


# ---------------------------------------------------------------------------- operating point
def test_operating_point_clamps_and_rounds() -> None:
    assert operating_batch_size(0.2) == 1
    assert operating_batch_size(2.5) == 3  # half up, not to even
    assert operating_batch_size(3.49) == 3
    assert operating_batch_size(1000.0) == 256
    assert operating_batch_size(1000.0, max_batch=64) == 64
    with pytest.raises(ValueError):
        operating_batch_size(4.0, max_batch=0)
    assert operating_context_len(1000.0, 129.0) == 1065  # 1000 + 64.5, half up
    assert operating_context_len(0.0, 0.0) == 1


def test_shape_operating_point_follows_concurrency() -> None:
    # 100 requests 0.1 s apart, each 2 s long (osl 20 x 0.1 s): ~20 in flight.
    reqs = [Request(i * 0.1, 100, 20) for i in range(100)]
    model = ServiceModel(prefill_tokens_per_s=1e9, tpot_s=0.1)
    shape = TrafficShape.from_requests(reqs, service=model)
    assert shape.arrival_rate_rps == pytest.approx(10.0)
    assert shape.interarrival_cv == pytest.approx(0.0, abs=1e-9)
    assert 15 < shape.mean_concurrency < 20
    assert shape.batch_size == round(shape.mean_concurrency)
    assert TrafficShape.from_requests(reqs, service=model, max_batch=8).batch_size == 8
    assert shape.context_len == 110
    assert shape.expert_load_skew == 1.0
    assert any("estimated" in n for n in shape.notes)


def test_proto_round_trip() -> None:
    reqs = [Request(i * 0.37, 100 + 13 * i, 5 + i % 7, (0, i)) for i in range(50)]
    shape = TrafficShape.from_requests(reqs, source="t.jsonl", expert_load_skew=1.7)
    msg = shape.to_proto()
    assert msg.batch_size == shape.batch_size and msg.isl_tokens.p99 == shape.isl_tokens.p99
    back = TrafficShape.from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == shape
    assert back.notes == ()


# ---------------------------------------------------------------------------- malformed files
def _azure(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """An Azure CSV of n rows one second apart; bad maps a 0-based row to its replacement."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = datetime(2023, 11, 16, 18) + timedelta(seconds=i)
        lines.append(f"{t:%Y-%m-%d %H:%M:%S}.{i % 10**7:07d},{100 + i},10")
    for i, text in (bad or {}).items():
        lines[i + 1] = text
    path.write_text("\n".join(lines))
    return path


def _mooncake(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _row(ms: int, isl: int = 600, osl: int = 5) -> dict[str, object]:
    ids = [0, ms][: -(-isl // 512)]  # one id per 512-token block
    return {"timestamp": ms, "input_length": isl, "output_length": osl, "hash_ids": ids}


def test_malformed_row_below_threshold_is_skipped_and_reported(tmp_path: Path) -> None:
    # 0.1 % of 1,500 rows: one malformed row may be skipped. Row 700 sits on line 702.
    path = _azure(tmp_path / "a.csv", 1500, {700: "2023-11-16 18:00:00.0,12x,3"})
    with capture_logs() as logs:
        trace = read_trace(path)
    assert len(trace.requests) == 1499 and trace.reordered == 0
    assert [p.line for p in trace.problems] == [702]
    assert "ContextTokens" in trace.problems[0].reason
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings and warnings[0]["event"] == "trace_rows_skipped"
    assert f"{path}:702:" in warnings[0]["first"][0]


def test_too_many_malformed_rows_raise_naming_file_and_line(tmp_path: Path) -> None:
    path = _azure(tmp_path / "a.csv", 1500, {3: "2023-11-16 18:00:00.0,1,-4", 9: "nonsense,1,2"})
    with pytest.raises(TraceError) as err:
        read_trace(path)
    msg = str(err.value)
    assert f"{path}:5: negative GeneratedTokens" in msg
    assert f"{path}:11: unparsable time" in msg
    assert [p.line for p in err.value.problems] == [5, 11]


def test_a_file_of_garbage_stops_after_max_bad_rows(tmp_path: Path) -> None:
    path = _mooncake(tmp_path / "m.jsonl", ["{not json"] * 5000)
    with pytest.raises(TraceError, match=r"more than 100 malformed rows") as err:
        read_trace(path)
    assert f"{path}:1: invalid JSON" in str(err.value)
    assert "and 96 more" in str(err.value)


@pytest.mark.parametrize("name", ["e.csv", "e.jsonl", "e.trace"])
def test_empty_file_is_an_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests") as err:
        read_trace(path)
    assert str(path) in str(err.value)


def test_header_only_csv_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_azure(tmp_path / "h.csv", 0))


def test_unknown_format_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    path.write_text("PAR1 binary-ish\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(path)
    wrong = tmp_path / "w.csv"
    wrong.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match=r"w\.csv:1: not an Azure LLM trace header"):
        read_trace(wrong)


def test_format_is_recognised_by_content(tmp_path: Path) -> None:
    m = _mooncake(tmp_path / "m.txt", [_row(0), _row(1500)])
    assert read_trace(m).format == "mooncake_jsonl"
    a = _azure(tmp_path / "a.log", 3)
    assert read_trace(a).format == "azure_csv"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"timestamp": 5, "input_length": -1, "output_length": 5, "hash_ids": []}, "negative"),
        ({"timestamp": 5, "input_length": 10, "output_length": "x", "hash_ids": []}, "bad number"),
        ({"timestamp": 5, "input_length": 10, "output_length": 5}, "missing field 'hash_ids'"),
        ({"input_length": 10, "output_length": 5, "hash_ids": []}, "missing field 'timestamp'"),
        ({"timestamp": "noon", "input_length": 1, "output_length": 5, "hash_ids": []}, "time"),
        ({"timestamp": 5, "input_length": 1, "output_length": 5, "hash_ids": ["a"]}, "hash_ids"),
        ([1, 2, 3], "JSON object"),
    ],
)
def test_malformed_mooncake_rows(tmp_path: Path, row: object, reason: str) -> None:
    path = _mooncake(tmp_path / "m.jsonl", [_row(0), json.dumps(row), _row(10)])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:2:" in str(err.value) and reason in str(err.value)
    trace = read_trace(path, max_bad_fraction=1.0)
    assert len(trace.requests) == 2 and trace.problems[0].line == 2


def test_negative_tokens_in_azure_are_rejected(tmp_path: Path) -> None:
    path = _azure(tmp_path / "a.csv", 3, {1: "2023-11-16 18:00:01.0,-5,3"})
    with pytest.raises(TraceError, match=r"a\.csv:3: negative ContextTokens: -5"):
        read_trace(path)
    with pytest.raises(ValueError):
        Request(0.0, -1, 3)


def test_out_of_order_rows_are_sorted_and_counted(tmp_path: Path) -> None:
    # After the first row (rows before it are malformed: test_trace_policies.py).
    path = _mooncake(tmp_path / "m.jsonl", [_row(0, 2), _row(2000, 1), _row(1000, 3)])
    trace = read_trace(path)
    assert trace.reordered == 1
    assert [(r.arrival_s, r.isl) for r in trace.requests] == [(0.0, 2), (1.0, 3), (2.0, 1)]


def test_seven_fractional_digits_keep_100_ns(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9999999,1,1\n2023-11-17 00:00:00.0000001,1,1\n"
    )
    trace = read_trace(path)
    assert trace.requests[1].arrival_s == pytest.approx(2e-7, abs=1e-12)
