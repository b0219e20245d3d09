"""The candidate space agents search (CPU): dimensions, points, neighbours."""

from __future__ import annotations

import pytest

from kiln.agent_runner.space import (
    OP_PREFIX,
    THREADS,
    TORCH_COMPILE,
    CandidateSpace,
    Dimension,
    space_for,
    thread_counts,
)
from kiln.ops import registry
from kiln.workloads.candidate import REFERENCE_CANDIDATE, Candidate, Transform


def test_cpu_space_has_non_lossy_ops_threads_and_torch_compile() -> None:
    space = space_for("cpu", cpus=4)
    dims = {d.name: d.values for d in space.dims}
    assert dims["op:attention"] == (None, "sdpa")
    assert dims["op:qkv_proj"] == (None, "fused")
    assert dims["op:mlp"] == (None, "fused_gate_up")
    assert dims[THREADS] == (None, "1", "2", "4")
    assert dims[TORCH_COMPILE] == (None, "default")
    for d in space.dims:
        if d.op is not None:
            assert all(not registry.get(d.op, v).lossy for v in d.values if v)
    assert "op:moe" not in dims  # no implementation to choose from


def test_gpu_space_has_no_threads() -> None:
    assert THREADS not in {d.name for d in space_for("h200").dims}


def test_points_are_distinct_candidates_without_the_reference() -> None:
    space = space_for("cpu", cpus=2)
    points = list(space)
    assert len(points) == space.size - 1
    assert len({c.id for c in points}) == len(points)
    assert REFERENCE_CANDIDATE not in points
    assert all(space.contains(c) for c in points)
    assert not space.contains(Candidate.make({"attention": "flash-v9"}))


def test_candidate_and_assignment_round_trip() -> None:
    space = space_for("cpu", cpus=2)
    c = Candidate.make(
        {"attention": "sdpa", "mlp": "fused_gate_up"},
        [Transform.of("threads", n=2), Transform.of("torch_compile", mode="default")],
    )
    point = space.assignment(c)
    assert point[OP_PREFIX + "attention"] == "sdpa" and point[THREADS] == "2"
    assert point[OP_PREFIX + "rope"] is None
    assert space.candidate(point) == c


def test_neighbours_change_exactly_one_dimension() -> None:
    space = space_for("cpu", cpus=2)
    start = Candidate.make({"attention": "sdpa"})
    neighbours = space.neighbours(start)
    expected = sum(len(d.values) - 1 for d in space.dims) - 1  # minus the reference
    assert len(neighbours) == expected
    for dim, _, c in neighbours:
        before, after = space.assignment(start), space.assignment(c)
        assert {k for k in before if before[k] != after[k]} == {dim}
    assert all(not c.is_reference for _, _, c in neighbours)


def test_thread_counts() -> None:
    assert thread_counts(1) == (1, 2)
    assert thread_counts(6) == (1, 2, 4, 6)
    assert thread_counts(16) == (1, 2, 4, 8, 16)


def test_dimensions_are_checked() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        CandidateSpace([Dimension("threads", (None,)), Dimension("threads", (None,))])
    with pytest.raises(ValueError, match="at least one value"):
        CandidateSpace([Dimension("threads", ())])
