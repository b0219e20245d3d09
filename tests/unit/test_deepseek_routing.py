"""DeepSeek-V3's router (sigmoid scores, ``noaux_tc`` group-limited top-k with the correction
bias, ``norm_topk_prob``, ``routed_scaling_factor``) and MoE block (routed experts plus the
shared expert) on a case computed by hand; the MoE check's tie test on it; the expert-load skew
of a random-weight model with this router.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln.ops import mlp, moe
from kiln.ops.moe_routing import sigmoid_route
from kiln.runtime.moe_check import determined, routing_of
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model

from .test_mla_model import TINY

# 8 experts in 4 groups of 2: {0, 1}, {2, 3}, {4, 5}, {6, 7}; 2 groups kept, top-2 experts.
SCORES = [0.9, 0.1, 0.6, 0.55, 0.8, 0.3, 0.5, 0.45]
BIAS = [0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.2, 0.2]
# Without the bias, groups score (top-2 sums) 1.0, 1.15, 1.1, 0.95: groups 1 and 2 are kept and
# experts 4 (0.8) and 2 (0.6) chosen. With it the choice scores are 0.9, 0.1 | 0.6, 0.55 | 0.3,
# 0.3 | 0.7, 0.65: groups 3 (1.35) and 1 (1.15) are kept, so expert 0 (the best score, 0.9) is
# not eligible, and experts 6 (0.7) and 7 (0.65) beat expert 2 (0.6). Their weights come from the
# un-biased scores: 0.5 and 0.45, normalised (/ 0.95) and scaled by 2.
SCALING = 2.0
WANT_EXPERTS = [6, 7]
WANT_WEIGHTS = [2.0 * 0.5 / 0.95, 2.0 * 0.45 / 0.95]
SILU_1 = 1 / (1 + math.exp(-1))


def _params() -> dict[str, object]:
    """An ``moe`` site with hidden size 1 and width 1: router logits are the weights (x = 1);
    expert e computes ``(e + 1) * silu(x) * x``."""
    logits = [math.log(p / (1 - p)) for p in SCORES]
    experts = len(SCORES)
    return {
        "router_weight": torch.tensor(logits)[:, None],
        "gate_up_weight": torch.ones(experts, 2, 1),
        "down_weight": torch.arange(1.0, experts + 1)[:, None, None],
        "top_k": 2,
        "norm_topk_prob": True,
        "round_router_weights": False,
        "router_bias": None,
        "scoring": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "correction_bias": torch.tensor(BIAS),
        "routed_scaling_factor": SCALING,
    }


def test_the_router_picks_by_the_biased_scores_within_the_best_groups() -> None:
    p = _params()
    x = torch.ones(1, 1)
    weights, experts = moe.route(
        x, p["router_weight"], top_k=2, norm_topk_prob=True, scoring="sigmoid", n_group=4,
        topk_group=2, correction_bias=p["correction_bias"], routed_scaling_factor=SCALING,
    )  # fmt: skip
    order = experts[0].argsort()
    assert experts[0][order].tolist() == WANT_EXPERTS
    assert weights[0][order].tolist() == pytest.approx(WANT_WEIGHTS, rel=1e-6)
    logits = p["router_weight"].T  # type: ignore[union-attr]
    _, unbiased = sigmoid_route(
        logits, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, correction_bias=None,
        routed_scaling_factor=SCALING,
    )  # fmt: skip
    assert sorted(unbiased[0].tolist()) == [2, 4]
    _, ungrouped = sigmoid_route(
        logits, top_k=2, n_group=1, topk_group=1, norm_topk_prob=True,
        correction_bias=p["correction_bias"], routed_scaling_factor=SCALING,
    )  # fmt: skip
    assert sorted(ungrouped[0].tolist()) == [0, 6]  # 0.9 and 0.7: no group limit
    raw, _ = sigmoid_route(
        logits, top_k=2, n_group=4, topk_group=2, norm_topk_prob=False,
        correction_bias=p["correction_bias"], routed_scaling_factor=1.0,
    )  # fmt: skip
    assert sorted(raw[0].tolist()) == pytest.approx([0.45, 0.5], rel=1e-6)


@pytest.mark.parametrize("impl", ["reference", "gathered", "dense"])
def test_the_moe_block_with_its_shared_expert(impl: str) -> None:
    """Routed: ``w6 * 7 silu(1) + w7 * 8 silu(1)``; the shared expert (an ``mlp`` of width 1,
    down 0.5) adds ``0.5 silu(1)``, as the decoder adds ``shared_ffn`` to ``ffn``."""
    x = torch.ones(1, 1, 1)
    routed = getattr(moe, impl)(x, **_params())
    want = SILU_1 * (7 * WANT_WEIGHTS[0] + 8 * WANT_WEIGHTS[1])
    assert routed.item() == pytest.approx(want, rel=1e-6)
    shared = mlp.reference(
        x,
        gate_weight=torch.ones(1, 1),
        up_weight=torch.ones(1, 1),
        down_weight=torch.tensor([[0.5]]),
    )
    assert (routed + shared).item() == pytest.approx(want + 0.5 * SILU_1, rel=1e-6)


def test_the_moe_check_knows_a_clear_route_from_a_near_tie() -> None:
    p = _params()
    x = torch.ones(1, 1)
    assert determined(routing_of(x, p)).tolist() == [True]
    tie = dict(p, correction_bias=torch.tensor([0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.2, 0.15 + 1e-8]))
    # experts 2 (0.6) and 7 (0.45 + 0.15 + 1e-8) tie within rounding: not determined
    assert determined(routing_of(x, tie)).tolist() == [False]
    groups = dict(p, correction_bias=torch.tensor([0.15 + 1e-8, 0.0, 0, 0, -0.5, 0, 0.2, 0.2]))
    # group 0 (0.9 + 0.15 + 0.1) ties group 1 (1.15) within rounding: the group choice is not
    assert determined(routing_of(x, groups)).tolist() == [False]


def test_expert_load_skew_is_fitted_through_the_grouped_router() -> None:
    raw = {**TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 2}
    config = parse_config(raw, "tiny-deepseek").with_expert_skew(1.2)
    model = build_model(config, dtype=torch.float32, seed=1, max_batch=2, max_seq_len=8)
    report = model.expert_load
    assert report is not None and set(report.measured) == {1, 2}
    for layer, measured in report.measured.items():
        target = report.target[layer]
        distance = sum(abs(a - b) for a, b in zip(measured, target, strict=True)) / 2
        assert distance < 0.15, (layer, measured, target)
