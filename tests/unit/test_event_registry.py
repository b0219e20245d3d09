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
    assert data == {"status": "failed", "reason": ""}


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
