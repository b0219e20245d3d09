"""The operating point (kiln.domain.operating_point): one derivation from a traffic shape and an
engine's limits, the defaults stated once, and clear errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kiln.domain.operating_point import (
    DEFAULT_BATCH,
    DEFAULT_ISL,
    DEFAULT_OSL,
    OperatingPoint,
    OperatingPointError,
    operating_batch_size,
    operating_context_len,
)


def _traffic(**fields: Any) -> dict[str, Any]:
    return {"source": "synthetic", **fields}


def test_a_full_traffic_shape_sets_every_fact_and_notes_nothing() -> None:
    derived = OperatingPoint.from_traffic(
        _traffic(
            batch_size=12,
            context_len=3000,
            isl_tokens={"p50": 2048.0, "mean": 2500.0},
            osl_tokens={"p50": 256.0},
            expert_load_skew=1.7,
        )
    )
    assert derived.point == OperatingPoint(
        batch_size=12, context_len=3000, isl=2048, osl=256, expert_load_skew=1.7
    )
    assert derived.notes == ()


def test_context_is_isl_plus_half_osl_rounded_half_up() -> None:
    point = OperatingPoint.from_traffic(
        _traffic(batch_size=2, isl_tokens={"p50": 1000.0}, osl_tokens={"p50": 129.0})
    ).point
    assert (point.context_len, point.isl, point.osl) == (1065, 1000, 129)  # 1064.5 -> 1065
    assert operating_context_len(1000.0, 129.0) == 1065
    assert operating_context_len(0.0, 0.0) == 1
    # a direct construction derives the context the same way
    assert OperatingPoint(isl=1024, osl=1).context_len == 1025


def test_the_mean_stands_in_for_a_zero_p50() -> None:
    point = OperatingPoint.from_traffic(
        _traffic(batch_size=1, isl_tokens={"p50": 0.0, "mean": 300.4}, osl_tokens={"p50": 10})
    ).point
    assert (point.isl, point.context_len) == (300, 305)


def test_batch_from_concurrency_rounds_half_up_and_clamps() -> None:
    assert operating_batch_size(0.2) == 1
    assert operating_batch_size(2.5) == 3
    assert operating_batch_size(1000.0) == 256
    assert operating_batch_size(1000.0, max_batch=64) == 64
    with pytest.raises(OperatingPointError, match="max_batch must be >= 1"):
        operating_batch_size(4.0, max_batch=0)


def test_unset_fields_take_the_defaults_and_say_so() -> None:
    derived = OperatingPoint.from_traffic(_traffic())
    point = derived.point
    assert (point.batch_size, point.isl, point.osl) == (DEFAULT_BATCH, DEFAULT_ISL, DEFAULT_OSL)
    assert point.context_len == DEFAULT_ISL + DEFAULT_OSL // 2 == 1152
    assert point.expert_load_skew == 1.0
    assert derived.notes == (
        "traffic.batch_size unset: batch 1",
        "traffic.isl_tokens unset: ISL 1024",
        "traffic.osl_tokens unset: OSL 256",
        "traffic.context_len unset: p50 ISL + p50 OSL / 2 = 1152 tokens",
    )
    assert OperatingPoint() == point  # the type's own defaults are the same ones


def test_no_traffic_shape_is_one_note() -> None:
    derived = OperatingPoint.from_traffic(None)
    assert derived.point == OperatingPoint()
    assert derived.notes == ("no traffic shape: default batch-1 decode, ISL 1024, OSL 256",)


def test_json_uint_strings_are_read_as_numbers() -> None:
    point = OperatingPoint.from_traffic(_traffic(batch_size="6", context_len="40")).point
    assert (point.batch_size, point.context_len) == (6, 40)


def test_engine_limits_lower_batch_and_context_and_say_why() -> None:
    derived = OperatingPoint.from_traffic(
        _traffic(batch_size=30, context_len=1085, isl_tokens={"p50": 900}),
        max_batch=4,
        max_context=32,
        batch_limit="KILN_ENGINE_MAX_BATCH",
        context_limit="the model's window",
    )
    assert (derived.point.batch_size, derived.point.context_len) == (4, 32)
    assert derived.point.isl == 900  # ISL and OSL are the traffic's, not lowered
    assert derived.notes == (
        "traffic.osl_tokens unset: OSL 256",
        "batch clamped from 30 to 4 (KILN_ENGINE_MAX_BATCH)",
        "context clamped from 1085 to 32 tokens (the model's window)",
    )


def test_limits_above_the_point_change_nothing() -> None:
    point = OperatingPoint(batch_size=3, context_len=24)
    derived = point.lowered(max_batch=8, max_context=512)
    assert derived.point == point and derived.notes == ()
    with pytest.raises(OperatingPointError, match="max_context must be >= 1"):
        point.lowered(max_context=0)


def test_a_measured_batch_and_context_win_over_the_derived_ones() -> None:
    point = OperatingPoint(batch_size=8, context_len=512, isl=400, osl=224)
    assert point.as_measured(6, 0) == OperatingPoint(
        batch_size=6, context_len=512, isl=400, osl=224
    )
    assert point.as_measured() == point


def test_skew_below_one_reads_as_balanced() -> None:
    point = OperatingPoint.from_traffic(_traffic(expert_load_skew=0.5)).point
    assert point.expert_load_skew == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": -2}, r"traffic\.batch_size must be a finite number >= 0"),
        ({"batch_size": 2.5}, r"traffic\.batch_size must be a whole number"),
        ({"context_len": "lots"}, r"traffic\.context_len 'lots' is not a number"),
        ({"isl_tokens": {"p50": float("nan")}}, r"traffic\.isl_tokens\.p50 must be a finite"),
        ({"osl_tokens": {"mean": -1.0}}, r"traffic\.osl_tokens\.mean must be a finite"),
        ({"osl_tokens": 7}, r"traffic\.osl_tokens must be a distribution"),
        ({"expert_load_skew": "Infinity"}, r"traffic\.expert_load_skew must be a finite"),
    ],
)
def test_bad_traffic_is_a_clear_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(OperatingPointError, match=message):
        OperatingPoint.from_traffic(_traffic(**fields))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"context_len": -1}, "context_len must be an integer >= 0"),
        ({"isl": 1.5}, "isl must be an integer >= 0, got 1.5"),
        ({"osl": True}, "osl must be an integer >= 0"),
        ({"expert_load_skew": 0.5}, "expert_load_skew must be a finite number >= 1"),
    ],
)
def test_a_bad_point_is_a_clear_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(OperatingPointError, match=message):
        OperatingPoint(**fields)


def test_operating_point_errors_are_value_errors() -> None:
    assert issubclass(OperatingPointError, ValueError)


def test_the_domain_imports_no_transport_storage_or_torch() -> None:
    code = (
        "import sys, kiln.domain.operating_point; "
        "heavy = ('grpc', 'nats', 'sqlalchemy', 'torch', 'google.protobuf'); "
        "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
