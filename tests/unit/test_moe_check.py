"""The routing-aware gate's parts (:mod:`kiln.runtime.moe_check`) on their own: the tie
bound holds every rounding it claims to and no more, routes it calls determined are the same
under any such rounding, the per-call comparison covers the whole op (a skipped shared expert
fails), which rows the end-to-end comparison keeps, and that recorded inputs cannot be changed
under the check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.ops.moe import reference as moe_reference
from kiln.runtime import moe_check
from kiln.runtime.moe_check import RoutedCheck, check_call, determined, routing_of
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model
from tests.unit.engine_testing import TINY_LLAMA
from tests.unit.op_testing import DTYPES, randn

TINY_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def router(experts: int, hidden: int, top_k: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "router_weight": randn(experts, hidden, dtype=dtype, scale=0.1),
        "top_k": top_k,
        "norm_topk_prob": True,
        "router_bias": None,
    }


def chosen(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k expert sets as sorted ids ``[N, k]``."""
    return torch.topk(scores, k, dim=-1).indices.sort(dim=-1).values


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_radius_bounds_each_computation_of_a_score(dtype: torch.dtype) -> None:
    """The reference's score is within half the radius of the exact one, and a float32
    computation (never rounded to the model dtype) within the radius of the reference's."""
    torch.manual_seed(0)
    p = router(64, 256, 8, dtype)
    x = randn(512, 256, dtype=dtype)
    r = routing_of(x, p)
    exact = x.double() @ p["router_weight"].double().T
    assert bool(((r.scores.double() - exact).abs() <= r.radius.double() / 2).all())
    other = F.linear(x.float(), p["router_weight"].float())
    assert bool(((other - r.scores).abs() <= r.radius).all())
    # and not vacuous: far below the spread of the scores
    assert float(r.radius.median()) < 0.05 * float(r.scores.std())


@pytest.mark.parametrize("dtype", DTYPES)
def test_determined_routes_agree_under_any_rounding(dtype: torch.dtype) -> None:
    """Where the route is determined, the float64, float32 and reference scores (and ties broken
    the other way) choose the same experts; in bfloat16 the undetermined positions are where
    they do not."""
    torch.manual_seed(1)
    p = router(64, 128, 8, dtype)
    x = randn(4096, 128, dtype=dtype)
    r = routing_of(x, p)
    sure = determined(r)
    ref = chosen(r.scores, 8)
    exact = x.double() @ p["router_weight"].double().T
    fp32 = F.linear(x.float(), p["router_weight"].float())
    flipped = 63 - chosen(r.scores.flip(-1), 8).flip(-1)  # exact ties to the higher id
    for other in (chosen(exact, 8), chosen(fp32, 8), flipped.sort(-1).values):
        assert torch.equal(other[sure], ref[sure])
    if dtype == torch.bfloat16:
        differs = (chosen(fp32, 8) != ref).any(-1)
        assert bool(differs.any()), "no near tie in bfloat16: the test shows nothing"
        assert 0.005 < float((~sure).float().mean()) < 0.3


def test_exact_ties_and_degenerate_inputs() -> None:
    eye = torch.eye(4)
    p = {"router_weight": eye, "top_k": 2, "norm_topk_prob": True}
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert determined(routing_of(x, p)).tolist() == [True, False, False]
    every = {**p, "top_k": 4}  # nothing left out: nothing to tie with
    assert determined(routing_of(x, every)).tolist() == [True, True, True]
    biased = {**p, "router_bias": torch.tensor([0.0, 0.0, 5.0, 0.0])}  # the bias counts
    assert determined(routing_of(x[1:2], biased)).tolist() == [True]


def test_drift_only_takes_positions_away() -> None:
    torch.manual_seed(2)
    p = router(32, 64, 4, torch.bfloat16)
    r = routing_of(randn(2048, 64, dtype=torch.bfloat16), p)
    previous = determined(r)
    for drift in (1e-3, 1e-2, 5e-2):
        now = determined(r, drift)
        assert not bool((now & ~previous).any())
        assert int(now.sum()) < int(previous.sum())
        previous = now


# ------------------------------------------------------------------ one call: the whole op
def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def qwen2_moe(x: torch.Tensor, p: dict[str, Any], *, shared: bool = True) -> torch.Tensor:
    """A Qwen2-MoE-style block (transformers' ``Qwen2MoeSparseMoeBlock``): the routed experts
    plus a shared expert scaled by ``sigmoid(x . shared_gate)``."""
    routed = moe_reference(
        x,
        router_weight=p["router_weight"],
        gate_up_weight=p["gate_up_weight"],
        down_weight=p["down_weight"],
        top_k=p["top_k"],
        norm_topk_prob=p["norm_topk_prob"],
        round_router_weights=True,
    )
    if not shared:
        return routed
    scale = torch.sigmoid(F.linear(x, p["shared_gate"]))
    return routed + scale * _mlp(x, p["shared_gate_up"], p["shared_down"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_shared_expert_fails(dtype: torch.dtype) -> None:
    """No family kiln builds has shared experts; the comparison is over the op's whole output,
    so skipping one (Qwen2-MoE's, DeepSeek's) fails wherever the route is determined."""
    torch.manual_seed(3)
    e, h, i = 16, 64, 32
    p = {
        **router(e, h, 4, dtype),
        "gate_up_weight": randn(e, 2 * i, h, dtype=dtype, scale=0.1),
        "down_weight": randn(e, h, i, dtype=dtype, scale=0.1),
        "shared_gate": randn(1, h, dtype=dtype, scale=0.1),
        "shared_gate_up": randn(2 * i, h, dtype=dtype, scale=0.1),
        "shared_down": randn(h, i, dtype=dtype, scale=0.1),
    }
    x = randn(3, 11, h, dtype=dtype)
    want = qwen2_moe(x, p)
    sure = determined(routing_of(x, p))
    assert bool(sure.any())
    rtol = {torch.float32: 1e-3, torch.bfloat16: 5e-2}[dtype]
    _, _, why = check_call(qwen2_moe(x, p, shared=False), want, sure, rtol)
    assert why.startswith("max |error|")
    honest = qwen2_moe(x.float(), {k: v.float() if isinstance(v, torch.Tensor) else v
                                   for k, v in p.items()}).to(dtype)  # fmt: skip
    err, tol, why = check_call(honest, want, sure, rtol)
    assert why == "" and err <= tol


def test_only_determined_positions_are_compared_but_all_must_be_finite() -> None:
    want = torch.ones(2, 3, 4)
    sure = torch.tensor([True, True, False, True, True, True])
    wrong_where_unsure = want.clone()
    wrong_where_unsure[0, 2] = 100.0
    assert check_call(wrong_where_unsure, want, sure, 1e-3)[2] == ""
    nan_where_unsure = want.clone()
    nan_where_unsure[0, 2, 0] = float("nan")
    assert check_call(nan_where_unsure, want, sure, 1e-3)[2] == "non-finite output"
    assert "output shape" in check_call(want[:, :2], want, sure, 1e-3)[2]
    assert check_call(want.tolist(), want, sure, 1e-3)[2].endswith("not a tensor")
    wrong = want.clone()
    wrong[1, 1] = 2.0
    err, tol, why = check_call(wrong, want, sure, 1e-3)
    assert err == pytest.approx(1.0) and tol == pytest.approx(1e-3) and "1 of 6" in why


# ------------------------------------------------------------------ on models
def _model(dtype: torch.dtype, config: dict[str, Any] = TINY_MOE) -> Any:
    return build_model(parse_config(config), dtype=dtype, seed=5, max_batch=3, max_seq_len=12)


def test_inert_for_a_dense_model() -> None:
    model = _model(torch.float32, {**TINY_LLAMA, "num_hidden_layers": 2})
    check = RoutedCheck(model, 1e-3)
    assert not check.applies
    assert check.record(model, "x") is model and check.rows(model) is None
    assert check.check_layers(model).correct and check.note() == ""


def _recorded(dtype: torch.dtype) -> tuple[Any, RoutedCheck, Any, list[torch.Tensor]]:
    model = _model(dtype)
    check = RoutedCheck(model, 5e-2 if dtype == torch.bfloat16 else 1e-3)
    view = check.record(model, "test")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(256, (3, 8), generator=gen)
    view.prefill(tokens, torch.tensor([8, 5, 7]))
    for _ in range(2):
        view.decode_step(torch.randint(256, (3, 1), generator=gen))
    rows = check.rows(view)
    assert rows is not None
    return model, check, view, rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_passes_its_own_per_layer_check(dtype: torch.dtype) -> None:
    model, check, _, rows = _recorded(dtype)
    assert len(rows) == 3 and all(r.shape == (3,) for r in rows)
    verdict = check.check_layers(model)
    assert verdict.correct and verdict.max_abs_error == 0.0, verdict.reason
    assert "per-layer check on the reference's inputs" in check.note()
    if dtype == torch.float32:
        assert all(bool(r.all()) for r in rows)  # float32 ties are rare: every row compared


@pytest.mark.parametrize("what", ["input", "mask"])
def test_a_recorded_input_or_mask_changed_after_the_reference_ran_fails(what: str) -> None:
    """What a candidate reaching them through gc could do: flatten the input (every route a
    tie, the reference's answer 0) or clear the mask (nothing compared)."""
    model, check, _, _ = _recorded(torch.bfloat16)
    rec = next(iter(check._recordings.values()))
    call = rec.steps[1].calls[0]
    assert call.sure is not None and bool(call.sure.any())
    (call.x if what == "input" else call.sure).zero_()
    verdict = check.check_layers(model)
    assert not verdict.correct
    assert "moe layer 0 (test step 1)" in verdict.reason
    assert "recorded input or mask changed after the reference ran" in verdict.reason


def test_which_rows_the_end_to_end_comparison_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes decided by the test: a prefill of 3 sequences (lengths 8, 5, 7), 2 decode steps.
    Sequence 0 ties at position 2 of layer 0 (attention follows: its row is left out from then
    on); sequence 1 at position 4 of the last layer, its own returned position (left out at the
    prefill only); sequence 2 at position 1 of the last layer (no attention follows: kept), and
    at decode step 2 at its own token (left out then only)."""
    _, check, view, _ = _recorded(torch.float32)
    rec = next(iter(check._recordings.values()))
    ties = {(0, 0, 0, 2), (0, 2, 1, 4), (0, 2, 2, 1), (2, 0, 2, 0)}  # (step, layer, seq, pos)
    where = {id(c.x): (s, c.layer) for s, step in enumerate(rec.steps) for c in step.calls}

    def fake_routing(x: torch.Tensor, params: Any) -> Any:
        step, layer = where[id(x)]
        b, t = x.shape[:2]
        sure = torch.ones(b, t, dtype=torch.bool)
        for s, layer_, seq, pos in ties:
            if (s, layer_) == (step, layer):
                sure[seq, pos] = False
        return sure.reshape(-1)

    monkeypatch.setattr(moe_check, "routing_of", lambda x, params: x)
    monkeypatch.setattr(moe_check, "determined", lambda x, drift=0.0: fake_routing(x, None))
    rows = check.rows(view)
    assert rows is not None
    assert [r.tolist() for r in rows] == [
        [False, False, True],
        [False, True, True],
        [False, True, False],
    ]
