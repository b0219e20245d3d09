"""The combiner composes the best single moves of other agents, best-first, unclaimed only."""

from __future__ import annotations

import pytest

from kiln.agent_runner.agents.combiner import CombinerAgent, best_moves, compositions
from kiln.agent_runner.space import CandidateSpace, Dimension
from kiln.domain.candidate import REFERENCE_CANDIDATE

from .agent_board import claim, result, view_of

SPACE = CandidateSpace(
    [
        Dimension("threads", (None, "1", "2")),
        Dimension("op:attention", (None, "sdpa")),
        Dimension("op:mlp", (None, "fused_gate_up")),
        Dimension("op:rope", (None, "cos_sin_cache")),
    ]
)


def _c(**point: str):  # type: ignore[no-untyped-def]
    return SPACE.candidate({k.replace("__", ":"): v for k, v in point.items()})


def test_moves_are_the_best_value_per_dimension_from_correct_results() -> None:
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0, agent="baseline"),
        result(_c(threads="1"), 110.0, agent="a"),
        result(_c(threads="2"), 150.0, agent="b"),
        result(_c(op__attention="sdpa"), 120.0, agent="a"),
        result(_c(op__mlp="fused_gate_up"), 90.0, agent="a"),  # slower: no move
        result(_c(op__rope="cos_sin_cache"), 500.0, status="incorrect"),  # wrong: no move
    )
    moves = best_moves(view, SPACE)
    assert [(m.dim, m.value, m.agent) for m in moves] == [
        ("threads", "2", "b"),
        ("op:attention", "sdpa", "a"),
    ]
    assert moves[0].speedup == pytest.approx(1.5)


def test_a_two_move_result_credits_each_move_with_the_square_root() -> None:
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0), result(_c(threads="2", op__mlp="fused_gate_up"), 144.0)
    )
    moves = {m.dim: m.speedup for m in best_moves(view, SPACE)}
    assert moves == pytest.approx({"threads": 1.2, "op:mlp": 1.2})


def test_proposes_the_best_predicted_composition_then_the_next_unclaimed() -> None:
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0),
        result(_c(threads="2"), 150.0, agent="coordinate"),
        result(_c(op__attention="sdpa"), 120.0, agent="optuna"),
        result(_c(op__mlp="fused_gate_up"), 110.0, agent="profiler"),
    )
    agent = CombinerAgent("combiner", 1)
    first = agent.propose(view, SPACE)
    # all three: 1.5 x 1.2 x 1.1 = 1.98 beats every pair
    assert first is not None
    assert first.candidate == _c(threads="2", op__attention="sdpa", op__mlp="fused_gate_up")
    assert "predicted x1.98" in first.why and "threads=2 (x1.5, coordinate)" in first.why
    view.take(claim(first.candidate))
    second = agent.propose(view, SPACE)
    assert second is not None and second.candidate == _c(threads="2", op__attention="sdpa")
    agent.tried.add(second.candidate.id)
    third = agent.propose(view, SPACE)
    assert third is not None and third.candidate == _c(threads="2", op__mlp="fused_gate_up")


def test_nothing_without_a_baseline_or_with_one_move() -> None:
    agent = CombinerAgent("combiner", 1)
    assert agent.propose(view_of(result(_c(threads="2"), 150.0)), SPACE) is None
    one = view_of(result(REFERENCE_CANDIDATE, 100.0), result(_c(threads="2"), 150.0))
    assert agent.propose(one, SPACE) is None


def test_compositions_are_ranked_by_the_product() -> None:
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0),
        result(_c(threads="2"), 130.0),
        result(_c(op__attention="sdpa"), 120.0),
        result(_c(op__rope="cos_sin_cache"), 101.0),
    )
    combos = compositions(best_moves(view, SPACE))
    assert len(combos) == 4  # 3 pairs + 1 triple
    products = [round(float(__import__("math").prod(m.speedup for m in c)), 6) for c in combos]
    assert products == sorted(products, reverse=True)
