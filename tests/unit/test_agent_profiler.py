"""The profiler attacks the op furthest above its roofline, on top of the best so far."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kiln.agent_runner.agents.base import Lab
from kiln.agent_runner.agents.profiler import ProfilerAgent, rank_gaps
from kiln.agent_runner.op_roofline import bandwidth_bytes_per_s, op_bytes, roofline_ms
from kiln.agent_runner.space import CandidateSpace, Dimension
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.workloads.config import load_config

from .agent_board import claim, result, view_of

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
SHAPE = {"layers": 2, "batch_size": 4, "context_len": 512, "dtype_bytes": 2}
SPACE = CandidateSpace(
    [
        Dimension("cuda_graph", (None, "on")),
        Dimension("op:attention", (None, "sdpa", "flash")),
        Dimension("op:mlp", (None, "fused_gate_up")),
        Dimension("op:rope", (None, "cos_sin_cache")),
    ]
)


@pytest.fixture(scope="module")
def floor() -> dict[str, float]:
    config = load_config(MODELS / "llama-3.2-1b.json")
    bw, _ = bandwidth_bytes_per_s("h200")
    return roofline_ms(op_bytes(config, **SHAPE), bw)


def _agent() -> ProfilerAgent:
    agent = ProfilerAgent("profiler", 1)
    agent.configure(load_config(MODELS / "llama-3.2-1b.json"), "h200")
    return agent


def _profile(floor: dict[str, float], gaps: dict[str, float]) -> dict[str, float]:
    return {op: floor[op] + gaps.get(op, 0.01) for op in ("attention", "mlp", "rope", "lm_head")}


def test_gaps_are_measured_minus_roofline_largest_first(floor: dict[str, float]) -> None:
    config = load_config(MODELS / "llama-3.2-1b.json")
    bw, _ = bandwidth_bytes_per_s("h200")
    ranked = rank_gaps(_profile(floor, {"mlp": 0.5, "attention": 0.2}), SHAPE, config, bw)
    assert [g.op for g in ranked[:2]] == ["mlp", "attention"]
    assert ranked[0].gap_ms == pytest.approx(0.5)
    assert ranked[0].roofline_ms == pytest.approx(floor["mlp"])


def test_attacks_the_largest_gap_and_moves_on_when_used_up(floor: dict[str, float]) -> None:
    agent = _agent()
    profile = _profile(floor, {"attention": 0.9, "mlp": 0.3})
    view = view_of(result(REFERENCE_CANDIDATE, 100.0, op_ms=profile, shape=SHAPE))
    first = agent.propose(view, SPACE)
    assert first is not None
    assert dict(first.candidate.ops) == {"attention": "sdpa"}  # values in the space's order
    assert first.why.startswith("op attention: measured ")
    assert f"roofline {floor['attention']:.4g} ms/step" in first.why
    view.take(claim(first.candidate))
    second = agent.propose(view, SPACE)
    assert second is not None and dict(second.candidate.ops) == {"attention": "flash"}
    agent.tried.add(second.candidate.id)
    third = agent.propose(view, SPACE)  # attention used up: the next op by gap
    assert third is not None and dict(third.candidate.ops) == {"mlp": "fused_gate_up"}


def test_builds_on_the_best_and_reranks_on_a_new_profiled_leader(floor: dict[str, float]) -> None:
    agent = _agent()
    graph = SPACE.candidate({"cuda_graph": "on"})
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0, op_ms=_profile(floor, {"attention": 0.9}), shape=SHAPE),
        result(graph, 150.0),  # the best, not profiled: ranking stays the reference's
    )
    p = agent.propose(view, SPACE)
    assert p is not None and SPACE.assignment(p.candidate)["cuda_graph"] == "on"
    assert dict(p.candidate.ops) == {"attention": "sdpa"}
    # a new leader with a profile where mlp is now the worst op
    fused = SPACE.candidate({"cuda_graph": "on", "op:attention": "flash"})
    view.feed.add(result(fused, 200.0, op_ms=_profile(floor, {"mlp": 0.7}), shape=SHAPE))
    p = agent.propose(view, SPACE)
    assert p is not None and p.why.startswith("op mlp:")
    assert p.candidate == SPACE.candidate(
        {"cuda_graph": "on", "op:attention": "flash", "op:mlp": "fused_gate_up"}
    )


def test_nothing_to_do_without_a_profile_or_a_workload() -> None:
    agent = _agent()
    assert agent.propose(view_of(result(REFERENCE_CANDIDATE, 100.0)), SPACE) is None
    assert ProfilerAgent("p", 1).propose(view_of(), SPACE) is None


async def test_configures_itself_from_the_labs_workload(floor: dict[str, float]) -> None:
    config = json.loads((MODELS / "llama-3.2-1b.json").read_text())
    workload = SimpleNamespace(
        model=SimpleNamespace(config_json=json.dumps(config), name="llama"),
        hardware=SimpleNamespace(name="h200"),
    )
    lab: Any = SimpleNamespace(space=SPACE, workload=workload)
    agent = ProfilerAgent("profiler", 1)
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0, op_ms=_profile(floor, {"rope": 2.0}), shape=SHAPE)
    )
    p = await agent.next_proposal(view, cast(Lab, lab))
    assert p is not None and dict(p.candidate.ops) == {"rope": "cos_sin_cache"}
    assert agent.bandwidth == pytest.approx(4.26e12)
    assert await ProfilerAgent("p", 1).next_proposal(view, cast(Lab, SimpleNamespace())) is None
