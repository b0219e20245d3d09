"""GLM-5's sparse-attention indexer ops (:mod:`kiln.ops.dsa_indexer`) on hand-made cases: the
score equation, top-k among visible slots only with ``-1`` for the rest, query chunking, the
selection mask ``mla_attention`` applies; and what the family refuses (cross-layer top-k sharing,
no q LoRA, plain rope layout, ``mla_attention`` implementations that cannot take the selection,
``fused_decode``), with reasons (its checkpoints: ``test_glm_moe_dsa_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kiln.ops import attention, dsa_indexer
from kiln.ops.mla import selection_mask
from kiln.ops.registry import register, unregister
from kiln.runtime.fused_decode import unsupported_reason
from kiln.runtime.support import support_for
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model
from kiln.workloads.models.binding import BindError, OpBinding
from kiln.workloads.models.build import UnbuildableModelError, check_buildable

from .test_glm_moe_dsa_model import TINY


def _scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``sum_h w[b, t, h] relu(q[b, h, t] . k[b, 0, s] * scale)``, one loop per head."""
    out = torch.zeros(q.shape[0], q.shape[2], keys.shape[2])
    for h in range(q.shape[1]):
        out += w[:, :, h, None] * torch.relu(q[:, h] @ keys[:, 0].transpose(-1, -2) * scale)
    return out


def test_the_top_k_of_the_visible_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    b, heads, t, s, d = 2, 3, 4, 9, 8
    q = torch.randn(b, heads, t, d, generator=gen)
    w = torch.randn(b, t, heads, generator=gen)
    keys = torch.randn(b, 1, s, d, generator=gen)
    positions = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]])
    seq_lens = torch.tensor([4, 7])
    got = dsa_indexer.reference(q, w, keys, positions, seq_lens, scale=0.5, topk=3)
    assert got.shape == (b, t, 3) and got.dtype == torch.int64
    want = _scores(q, w, keys, 0.5)
    for bi in range(b):
        for ti in range(t):
            visible = int(positions[bi, ti]) + 1
            picked = sorted(int(i) for i in got[bi, ti] if i >= 0)
            best = want[bi, ti, :visible].topk(min(3, visible)).indices
            assert picked == sorted(best.tolist()), (bi, ti)
            assert (got[bi, ti] < 0).sum() == max(0, 3 - visible)
    # every slot at top-k >= S; query chunks give the same choice
    every = dsa_indexer.reference(q, w, keys, positions, seq_lens, scale=0.5, topk=100)
    assert every.shape == (b, t, s)
    mask = attention.cache_mask(positions, seq_lens, s)
    assert torch.equal(selection_mask(every, s), mask)


def test_query_chunks_choose_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    q, w = torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 6, 2, generator=gen)
    keys = torch.randn(1, 1, 8, 4, generator=gen)
    args = (q, w, keys, torch.arange(6)[None], torch.tensor([6]))
    whole = dsa_indexer.reference(*args, scale=1.0, topk=2)
    monkeypatch.setattr(dsa_indexer, "SCORES_BUDGET", 2 * 8)  # one query per chunk
    assert torch.equal(dsa_indexer.reference(*args, scale=1.0, topk=2), whole)


def test_the_projection_rotates_its_leading_dims_deinterleaved() -> None:
    gen = torch.Generator().manual_seed(2)
    h, rq, heads, d, rope = 16, 8, 2, 6, 4
    p: dict[str, Any] = {
        "q_a_weight": torch.randn(rq, h, generator=gen), "q_a_norm": torch.ones(rq),
        "q_b_weight": torch.randn(heads * d, rq, generator=gen),
        "k_weight": torch.randn(d, h, generator=gen), "k_norm_weight": torch.ones(d),
        "k_norm_bias": torch.zeros(d), "head_weight": torch.randn(heads, h, generator=gen),
        "num_heads": heads, "head_dim": d, "rope_dim": rope, "eps": 1e-6, "k_norm_eps": 1e-6,
    }  # fmt: skip
    x = torch.randn(1, 3, h, generator=gen)
    q, k, w = dsa_indexer.reference_proj(x, **p, interleaved=True)
    q0, k0, _ = dsa_indexer.reference_proj(x, **p, interleaved=False)
    assert q.shape == (1, heads, 3, d) and k.shape == (1, 1, 3, d) and w.shape == (1, 3, heads)
    order = [0, 2, 1, 3, 4, 5]
    assert torch.equal(q, q0[..., order]) and torch.equal(k, k0[..., order])
    assert torch.allclose(k0.mean(-1), torch.zeros(1, 1, 3), atol=1e-5)  # a LayerNorm
    assert torch.allclose(w, x @ p["head_weight"].T * heads**-0.5)


def test_what_is_not_built_is_refused_by_name() -> None:
    for change, why in (
        ({"index_topk_freq": 2}, "cross-layer top-k sharing"),
        ({"indexer_types": ["full", "shared", "full"]}, "cross-layer top-k sharing"),
        ({"q_lora_rank": None}, "without q LoRA"),
        ({"indexer_rope_interleave": False}, "plain rope layout"),
        ({"index_head_dim": 4}, "index_head_dim 4 below"),
        ({"topk_method": "greedy"}, "top-k method 'greedy'"),
    ):
        with pytest.raises(UnbuildableModelError, match=why):
            check_buildable(parse_config({**TINY, **change}, "tiny"))


@pytest.fixture
def blind_attention() -> Iterator[str]:
    """An ``mla_attention`` implementation without ``topk_indices`` (registered for the test)."""

    def blind(
        q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
        rope_cache: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, *,
        kv_b_weight: torch.Tensor, nope_dim: int, v_dim: int, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        raise AssertionError("never called")

    register("mla_attention", "test_blind")(blind)
    yield "test_blind"
    unregister("mla_attention", "test_blind")


def test_implementations_without_the_selection_are_refused(blind_attention: str) -> None:
    config = parse_config(TINY, "tiny-glm")
    with pytest.raises(BindError, match="topk_indices"):
        build_model(config, dtype=torch.float32, recipe={"mla_attention": blind_attention})
    model = build_model(config, dtype=torch.float32)
    with pytest.raises(BindError, match="topk_indices"):
        model.rebind(OpBinding.from_recipe({"mla_attention": blind_attention}))
    for device in ("cpu", "cuda"):
        support = support_for(TINY, device, name="tiny-glm")
        reason = support.op_reason("mla_attention", blind_attention) or ""
        assert "topk_indices" in reason and "sparse-attention indexer" in reason
        assert support.op_reason("mla_attention", "absorbed") is None
        assert "latent" in (support.op_reason("attention", "sdpa") or "")
        assert support.transform_reason("fused_decode")
    assert "latent attention" in (unsupported_reason(config) or "")
    deepseek = support_for({**TINY, "model_type": "deepseek_v3"}, "cpu", name="tiny-deepseek")
    assert deepseek.op_reason("mla_attention", blind_attention) is None
    assert "indexer" in (deepseek.op_reason("dsa_indexer", "anything") or "")
