"""The fused MoE router (:mod:`kiln.ops.kernels.moe_router`) through Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported) against :func:`kiln.ops.moe.route` per
dtype, family, expert count and top-k; bad arguments refused."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kiln.ops.moe import route
from tests.unit.op_testing import DTYPES, randn

FAMILIES = {  # norm_topk_prob, round weights, router bias
    "qwen3-moe": (True, True, False),
    "mixtral": (True, False, False),
    "no-norm-bias": (False, True, True),
}
GAP = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Relative gap between the k-th and (k+1)-th probability below which a token's choice is a
near-tie that a logit rounded the other way may flip (skipped); also the weights' rtol."""


def _route(x, w, top_k, norm, rounded, bias):  # type: ignore[no-untyped-def]
    weights, experts = route(x, w, top_k=top_k, norm_topk_prob=norm, router_bias=bias)
    return (weights.to(x.dtype).float() if rounded else weights), experts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    ("experts", "top_k", "per_program"), [(8, 2, None), (60, 4, 16), (128, 8, 4)]
)
def test_fused_router_routes_as_route(
    dtype: torch.dtype, family: str, experts: int, top_k: int, per_program: int | None
) -> None:
    from kiln.ops.kernels.moe_router import moe_router

    norm, rounded, biased = FAMILIES[family]
    torch.manual_seed(experts + top_k)
    hidden, n = 96, 7
    x = randn(n, hidden, dtype=dtype)
    w = randn(experts, hidden, dtype=dtype, scale=0.3)
    bias = torch.linspace(1.0, -1.0, experts) if biased else None
    weights, ids = moe_router(
        x, w, top_k=top_k, norm_topk_prob=norm, round_weights=rounded, router_bias=bias,
        experts_per_program=per_program,
    )  # fmt: skip
    want_w, want_ids = _route(x, w, top_k, norm, rounded, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert weights.shape == ids.shape == (n, top_k)
    logits = torch.nn.functional.linear(x, w).float()
    probs = torch.softmax(logits if bias is None else logits + bias, dim=-1)
    top = torch.topk(probs, min(top_k + 1, experts), dim=-1).values
    gap = (top[:, top_k - 1] - top[:, top_k]) / top[:, top_k - 1] if top_k < experts else None
    clear = None if gap is None else gap > GAP[dtype]
    checked = 0
    for t in range(n):
        if clear is not None and not bool(clear[t]):
            continue
        checked += 1
        assert set(ids[t].tolist()) == set(want_ids[t].tolist())
        order = torch.argsort(ids[t])
        want_order = torch.argsort(want_ids[t])
        torch.testing.assert_close(
            weights[t][order], want_w[t][want_order], rtol=GAP[dtype], atol=1e-6
        )
        assert bool((weights[t][:-1] >= weights[t][1:]).all())  # largest first
    assert checked >= 2


def test_ties_go_to_the_lower_expert_id() -> None:
    from kiln.ops.kernels.moe_router import moe_router

    x = torch.ones(2, 16)
    w = torch.zeros(6, 16)  # every logit equal: a six-way tie
    w[4] = 1.0
    weights, ids = moe_router(x, w, top_k=3, norm_topk_prob=True)
    assert ids.tolist() == [[4, 0, 1], [4, 0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize(
    ("x", "w", "kwargs", "message"),
    [
        ((3, 8), (4, 9), {}, "must be"),
        ((3, 8), (4, 8), {"top_k": 5}, "top_k"),
        ((3, 8), (4, 8), {"router_bias": torch.zeros(3)}, "router_bias"),
        ((3, 8), (4, 8), {"experts_per_program": 3}, "power of two"),
    ],
)
def test_bad_arguments_are_refused(x, w, kwargs, message) -> None:  # type: ignore[no-untyped-def]
    from kiln.ops.kernels.moe_router import moe_router

    args = {"top_k": 2, "norm_topk_prob": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        moe_router(torch.randn(*x), torch.randn(*w), **args)
