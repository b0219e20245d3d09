"""The candidate space agents search (CPU): dimensions, points, neighbours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.agent_runner.space import (
    CUDA_GRAPH,
    OP_PREFIX,
    THREADS,
    TORCH_COMPILE,
    CandidateSpace,
    Dimension,
    Exclusion,
    space_for,
    thread_counts,
    unused_ops,
)
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform
from kiln.ops import registry
from kiln.workloads.config import parse_config

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"


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
    assert CUDA_GRAPH not in dims  # GPU targets only


def test_gpu_space_has_cuda_graphs_and_no_threads() -> None:
    names = {d.name for d in space_for("h200").dims}
    assert THREADS not in names and CUDA_GRAPH in names


def test_ops_a_model_never_calls_are_left_out() -> None:
    llama = parse_config(json.loads((MODELS / "llama-3.2-1b.json").read_text()), "llama")
    qwen_moe = parse_config(json.loads((MODELS / "qwen3-30b-a3b.json").read_text()), "qwen")
    space = space_for("cpu", cpus=2)
    dense = {d.name for d in space.without_ops(unused_ops(llama)).dims}
    assert "op:moe" not in dense and "op:mlp" in dense
    moe = {d.name for d in space.without_ops(unused_ops(qwen_moe)).dims}
    assert "op:moe" in moe and "op:mlp" not in moe


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


def test_exclusions_keep_pairs_out_of_points_moves_and_iteration() -> None:
    space = CandidateSpace(
        [Dimension("cuda_graph", (None, "on")), Dimension("op:moe", (None, "dense"))],
        [Exclusion("cuda_graph", "op:moe", None, "host sync")],
    )
    graph = Candidate.make(transforms=[Transform.of("cuda_graph")])
    both = Candidate.make({"moe": "dense"}, [Transform.of("cuda_graph")])
    assert list(space) == [Candidate.make({"moe": "dense"}), both]
    assert not space.contains(graph) and space.refusal(graph) == "host sync"
    assert [c for _, _, c in space.neighbours(REFERENCE_CANDIDATE)] == [
        Candidate.make({"moe": "dense"})
    ]
    assert space.refusal(both) is None and space.without_ops(frozenset({"moe"})).exclusions == ()


def test_within_drops_refused_values_and_a_refused_transforms_parameters() -> None:
    from kiln.runtime.support import support_for

    qwen_moe = json.loads((MODELS / "qwen3-30b-a3b.json").read_text())
    space = space_for("h200").within(support_for(qwen_moe, "cuda"))
    names = {d.name for d in space.dims}
    assert "op:mlp" not in names and CUDA_GRAPH in names and space.support is not None
    biased = {**json.loads((MODELS / "qwen3-8b.json").read_text()), "attention_bias": True}
    names = {d.name for d in space_for("h200").within(support_for(biased, "cuda")).dims}
    assert "fused_decode" not in names and not any(n.startswith("fused_decode.") for n in names)
    cpu = space_for("cpu").within(support_for(qwen_moe, "cpu"))
    assert all(
        registry.get(d.op, v).runs_on("cpu") for d in cpu.dims if d.op for v in d.values if v
    )
