"""kiln's routing per family against the routers of transformers' sparse MoE blocks
(``Qwen3MoeSparseMoeBlock.gate``, ``MixtralSparseMoeBlock.gate``, transformers >= 5): for each
family kiln builds, a small config parsed by kiln and by transformers, the same router weights and
hidden states, in float32 and bfloat16.

The router logits the gate ranks by (:func:`kiln.runtime.moe_check.routing_of`) are
transformers' bit for bit; where the gate calls a route determined, kiln's top-k experts
(:func:`kiln.ops.moe.route`, and the gate's :func:`~kiln.runtime.moe_check.decisions`) are
transformers', with the same combine weights (renormalised or not as the config says, rounded to
the model dtype for Qwen3-MoE and kept in float32 for Mixtral, as kiln's ``MoEConfig`` says).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.ops.moe import route
from kiln.runtime.moe_check import decisions, determined, routing_of
from kiln.workloads.config import parse_config
from tests.unit.op_testing import DTYPES

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed (pip install 'transformers>=5'): kiln's routing is "
    "compared with transformers' MoE routers only where it is",
)

HIDDEN = 96
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "qwen3_moe-nonorm": {
        "model_type": "qwen3_moe",
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
    },
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
}


def raw_config(family: str) -> dict[str, Any]:
    return {
        "vocab_size": 128,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **FAMILIES[family],
    }


def hf_router(raw: dict[str, Any]) -> Any:
    """The router of transformers' sparse MoE block of the family (``block.gate``), or a skip
    where this transformers routes inside the block's forward (< 5: ``gate`` is a plain
    ``nn.Linear`` and the choice is not exposed)."""
    config = transformers.AutoConfig.for_model(**raw)
    if raw["model_type"] == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as Block,
        )
    gate = Block(config).gate
    if isinstance(gate, torch.nn.Linear):
        pytest.skip(f"transformers {transformers.__version__} has no router module (< 5)")
    return gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_routing_matches_transformers(family: str, dtype: torch.dtype) -> None:
    raw = raw_config(family)
    moe = parse_config(raw, family).moe
    assert moe is not None
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(moe.num_experts, HIDDEN, generator=gen) * 0.1).to(dtype)
    x = torch.randn(2048, HIDDEN, generator=gen).to(dtype)
    router = hf_router(raw)
    router.weight.data = weight.clone()
    router = router.to(dtype).eval()
    with torch.no_grad():
        hf_logits, hf_weights, hf_experts = router(x)
    params = {"router_weight": weight, "top_k": moe.top_k, "norm_topk_prob": moe.norm_topk_prob}

    routing = routing_of(x, params)
    assert torch.equal(routing.scores, hf_logits.float())
    sure = determined(routing)
    assert float(sure.float().mean()) > 0.5
    order = hf_experts.argsort(dim=-1)
    want_experts = hf_experts.gather(1, order)[sure]
    want_weights = hf_weights.gather(1, order)[sure]
    # transformers rounds the weights to the model dtype exactly where kiln's config says so
    assert (hf_weights.dtype == dtype) == (moe.round_router_weights or dtype == torch.float32)
    for w, e in (
        route(x, weight, top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob),
        decisions(x, params),
    ):
        if moe.round_router_weights:
            w = w.to(dtype)
        mine = e.argsort(dim=-1)
        assert torch.equal(e.gather(1, mine)[sure], want_experts)
        torch.testing.assert_close(w.gather(1, mine)[sure], want_weights, rtol=0, atol=0)
    if moe.norm_topk_prob:
        sums = hf_weights.float().sum(dim=-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-2)
