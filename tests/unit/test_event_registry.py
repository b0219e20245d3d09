"""The event-type registry: stream ids, schema lookup and payload validation."""

from __future__ import annotations

import pytest

from kiln.events import (
    SchemaError,
    latest_version,
    parse_stream_id,
    registered_types,
    validate_event,
)


@pytest.mark.parametrize(
    "stream_id", ["compilation-abc", "experiment-0f3A_x-y", "engine_pool-1", "a-" + "x" * 128]
)
def test_valid_stream_ids_split_into_category_and_id(stream_id: str) -> None:
    sid = parse_stream_id(stream_id)
    assert str(sid) == stream_id
    assert sid.category == stream_id.split("-", 1)[0]


@pytest.mark.parametrize(
    "stream_id",
    [
        "",
        "compilation",
        "compilation-",
        "Compilation-x",
        "1abc-x",
        "comp-a.b",
        "comp-a b",
        "c-*",
        "a-" + "x" * 129,
    ],
)
def test_invalid_stream_ids_are_rejected(stream_id: str) -> None:
    with pytest.raises(SchemaError, match="invalid stream id"):
        parse_stream_id(stream_id)


def test_every_registered_type_has_a_version_one_and_latest() -> None:
    types = registered_types()
    assert {
        "CompilationSubmitted",
        "ExperimentRequested",
        "ExperimentCompleted",
        "BestCandidateImproved",
    } <= set(types)
    for name, versions in types.items():
        assert versions[0] == 1
        assert latest_version(name) == versions[-1]


def test_validation_fills_defaults_and_normalises() -> None:
    version, data = validate_event("compilation-x", "CompilationEnded", 0, b'{"status": "failed"}')
    assert version == 1
    # An old payload (no outcome) still validates; the optional field takes its default.
    assert data == {"status": "failed", "reason": "", "outcome": ""}


def test_nested_schema_errors_name_the_field() -> None:
    payload = {
        "workload_key": "w",
        "model_name": "m",
        "hardware": "h200",
        "workload": {},
        "budget": {"wall_seconds": -1},
    }
    with pytest.raises(SchemaError, match=r"budget\.wall_seconds"):
        validate_event("compilation-x", "CompilationSubmitted", 1, payload)


def test_unknown_type_is_rejected() -> None:
    with pytest.raises(SchemaError, match="no registered schema"):
        latest_version("Nope")


def test_an_experiment_completed_before_the_timing_defenses_still_loads() -> None:
    """Events written before mean_ms, max_ms, verified_steps and escape_probability existed
    validate, with the defaults that mean "not recorded"."""
    old = {
        "compilation_id": "c1",
        "candidate_id": "x",
        "status": "ok",
        "correct": True,
        "median_ms": 10.0,
        "p10_ms": 9.0,
        "p90_ms": 11.0,
        "tokens_per_s": 300.0,
        "tier": "fast",
    }
    version, data = validate_event("experiment-e1", "ExperimentCompleted", 1, old)
    assert version == 1
    assert data["mean_ms"] == 0.0 and data["max_ms"] == 0.0
    assert data["verified_steps"] == 0 and data["escape_probability"] == 1.0
    assert {k: data[k] for k in old} == old
    new = {**old, "mean_ms": 10.5, "max_ms": 12.0, "verified_steps": 21}
    _, data = validate_event(
        "experiment-e1", "ExperimentCompleted", 1, {**new, "escape_probability": 0.8**21}
    )
    assert data["verified_steps"] == 21 and data["escape_probability"] == 0.8**21
    with pytest.raises(SchemaError, match="escape_probability"):
        validate_event("experiment-e1", "ExperimentCompleted", 1, {**old, "escape_probability": 2})
