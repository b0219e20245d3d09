"""The deployment aggregate, its ids, its policy's validation, the feed's records and the window
tracker's restart sequences."""

from __future__ import annotations

import hashlib

import pytest

from kiln.agent_runner.deployments.feed import FeedMessage, decode_message, decode_record
from kiln.agent_runner.deployments.policy import policy_from_json, resolve_policy
from kiln.agent_runner.deployments.records import compilation_id_for
from kiln.agent_runner.deployments.windows import WindowTracker
from kiln.common.errors import InvalidArgument
from kiln.domain.compilation import Event
from kiln.domain.deployment import (
    DeploymentState,
    InvalidName,
    Status,
    check_name,
    deployment_id,
    stream_of,
)
from kiln.events.registry import validate_event
from kiln.v1 import deployments_pb2
from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.windows import WindowSpec

STREAM = stream_of("team.a", "chat")
SHAPE_A = {"source": "a", "batch_size": 4}
SHAPE_B = {"source": "b", "batch_size": 8}


def _e(version: int, type_: str, **data: object) -> Event:
    validate_event(STREAM, type_, 0, dict(data))  # every payload here is a valid event
    return Event(type=type_, data=data, stream_id=STREAM, version=version)


def _created() -> Event:
    return _e(
        1,
        "DeploymentCreated",
        team="team.a",
        name="chat",
        workload={"traffic": SHAPE_A},
        policy={},
        drift_policy={},
    )


def test_ids_are_the_hash_of_team_and_name_and_do_not_collide() -> None:
    assert deployment_id("team.a", "chat") == hashlib.sha256(b"team.a/chat").hexdigest()[:32]
    assert deployment_id("team.a", "chat") != deployment_id("team.b", "chat")
    assert deployment_id("a.b", "c") != deployment_id("a", "b.c")
    assert STREAM == "deployment-" + deployment_id("team.a", "chat")
    assert compilation_id_for("ab" * 16, 3) == "dabababababababab-0003"
    for bad in ("", "-x", "a/b", "x" * 65, "white space"):
        with pytest.raises(InvalidName):
            check_name(bad)
    assert check_name("chat.eu-1_a") == "chat.eu-1_a"


def test_the_fold_follows_promotions_declines_and_rollbacks() -> None:
    events = [
        _created(),
        _e(2, "RecompilationStarted", compilation_id="c0", reason="initial", shape=SHAPE_A),
        _e(3, "CandidatePromoted", compilation_id="c0", candidate_id="k0", reason="initial",
           shape=SHAPE_A),
        _e(4, "TrafficWindowObserved", index=0, start_s=0.0, end_s=60.0, origin_s=0.0,
           requests=10, sparse=False, resume_sequence=3),
        _e(5, "DriftDetected", window_index=0, window_end_s=60.0, score=2.0, dominant="isl",
           consecutive=2, reason="drift"),
        _e(6, "RecompilationStarted", compilation_id="c1", reason="drift", window_index=0,
           window_end_s=60.0, shape=SHAPE_B, incumbent_candidate_id="k0"),
    ]  # fmt: skip
    state = DeploymentState.fold(events)
    assert state.status == Status.RECOMPILING and state.recompilations == 1
    assert state.next_window_index == 1 and state.compilations == ["c0", "c1"]
    state.apply(events[-1])  # replay is idempotent
    assert state.version == 6 and len(state.events) == 6
    state.apply(
        _e(7, "CandidatePromoted", compilation_id="c1", candidate_id="k1", reason="better",
           previous_candidate_id="k0", shape=SHAPE_B, rebased_at_s=60.0)
    )  # fmt: skip
    assert state.status == Status.ACTIVE and state.active and state.active.candidate_id == "k1"
    assert state.proven_shape == SHAPE_B and state.proven_at_s == 60.0
    state.apply(_e(8, "CandidateRolledBack", from_candidate_id="k1", to_candidate_id="k0",
                   to_compilation_id="c0"))  # fmt: skip
    assert state.active and state.active.candidate_id == "k0" and state.proven_shape == SHAPE_A


def test_a_failed_first_compilation_fails_the_deployment_and_a_decline_proves_the_shape() -> None:
    base = [
        _created(),
        _e(2, "RecompilationStarted", compilation_id="c0", reason="initial", shape=SHAPE_A),
    ]
    failed = DeploymentState.fold(
        [*base, _e(3, "PromotionDeclined", compilation_id="c0", reason="no winner",
                   compilation_failed=True)]
    )  # fmt: skip
    assert failed.status == Status.FAILED and failed.reason == "no winner"
    ok = DeploymentState.fold(
        [
            *base,
            _e(3, "CandidatePromoted", compilation_id="c0", candidate_id="k0", reason="initial"),
            _e(4, "RecompilationStarted", compilation_id="c1", reason="drift", shape=SHAPE_B),
            _e(5, "PromotionDeclined", compilation_id="c1", reason="not better", shape=SHAPE_B),
        ]
    )
    assert ok.status == Status.ACTIVE and ok.proven_shape == SHAPE_B
    assert ok.active and ok.active.candidate_id == "k0" and ok.last_verdict
    with pytest.raises(ValueError):
        DeploymentState.fold([base[1]])


def test_policy_defaults_and_refusals() -> None:
    resolved = resolve_policy(None)
    assert resolved.windows == WindowSpec() and resolved.message.budget.wall_seconds > 0
    again = policy_from_json(resolved.to_json(), dict(resolved.drift.to_dict()))
    assert again.windows == resolved.windows and again.drift == resolved.drift
    given = resolve_policy(deployments_pb2.DeploymentPolicy(window_s=120, threshold=2.0))
    assert given.windows.length_s == 120 and given.windows.step_s == 120
    assert given.drift.threshold == 2.0
    for bad in (
        deployments_pb2.DeploymentPolicy(window_s=60, step_s=120),
        deployments_pb2.DeploymentPolicy(threshold=float("nan")),
        deployments_pb2.DeploymentPolicy(promotion_margin=-0.1),
        deployments_pb2.DeploymentPolicy(agents=["nobody"]),
    ):
        with pytest.raises(InvalidArgument):
            resolve_policy(bad)


def test_feed_records_are_checked_and_bad_ones_skipped() -> None:
    assert decode_record({"arrival_s": 1, "isl": 3, "osl": 4, "hash_ids": [7]}) == Request(
        1.0, 3, 4, (7,)
    )
    for bad in ({"arrival_s": "x", "isl": 1, "osl": 1}, {"arrival_s": 1, "isl": -1, "osl": 1}):
        with pytest.raises(ValueError):
            decode_record(bad)
    msg = decode_message(5, b'{"records": [{"arrival_s": 1, "isl": 1, "osl": 1}, {"nope": 1}]}')
    assert msg.sequence == 5 and len(msg.requests) == 1
    assert decode_message(6, b'{"flush": true}').flush
    assert decode_message(7, b"not json").requests == ()


def test_the_tracker_resumes_from_the_oldest_message_an_open_window_needs() -> None:
    spec = WindowSpec(length_s=10, step_s=10, min_requests=1)
    tracker = WindowTracker(spec)
    closed = []
    for seq, t in enumerate([0.0, 5.0, 12.0, 15.0, 21.0], start=1):
        closed += tracker.add(FeedMessage(seq, (Request(t, 10, 10),)))
        for w in closed:
            tracker.recorded(w.index)
    assert [w.index for w in closed] == [0, 1]
    assert tracker.resume_after(1) == 5  # window 2 starts at 20: only message 5 is needed
    # A fresh tracker from there closes the same later windows.
    again = WindowTracker(spec, origin_s=0.0, closed_before=2, resume_sequence=5)
    late = again.add(FeedMessage(5, (Request(21.0, 10, 10),)))
    late += again.add(FeedMessage(6, (Request(31.0, 10, 10),)))
    assert [w.index for w in late] == [2] and len(late[0].requests) == 1
