"""``moe`` implementations: the reference against a plain per-token formula and transformers'
sparse MoE blocks; the alternatives against the reference over odd shapes and per dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.ops.moe import route
from kiln.ops.registry import get, implementations
from tests.unit.op_testing import DTYPES, assert_close, randn

ALTERNATIVES = [i for i in implementations("moe") if i != "reference"]


def moe_params(
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    *,
    norm: bool = True,
    round_weights: bool = True,
    bias: bool = False,
) -> dict[str, Any]:
    """Seeded random params (router scaled up so routing is far from uniform ties)."""
    return {
        "router_weight": randn(experts, hidden, dtype=dtype, scale=0.3),
        "gate_up_weight": randn(experts, 2 * inter, hidden, dtype=dtype, scale=0.08),
        "down_weight": randn(experts, hidden, inter, dtype=dtype, scale=0.08),
        "top_k": top_k,
        "norm_topk_prob": norm,
        "round_router_weights": round_weights,
        "router_bias": torch.linspace(2.0, -2.0, experts) if bias else None,
    }


def per_token(x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """The textbook formula in float64: for each token, sum_k w_k * expert_{e_k}(x)."""
    flat = x.reshape(-1, x.shape[-1]).double()
    logits = flat @ p["router_weight"].double().T
    if p["router_bias"] is not None:
        logits = logits + p["router_bias"].double()
    w, e = torch.topk(torch.softmax(logits, -1), p["top_k"], dim=-1)
    if p["norm_topk_prob"]:
        w = w / w.sum(-1, keepdim=True)
    inter = p["down_weight"].shape[-1]
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for k in range(p["top_k"]):
            gu = p["gate_up_weight"][e[n, k]].double()
            h = F.silu(gu[:inter] @ flat[n]) * (gu[inter:] @ flat[n])
            out[n] += w[n, k] * (p["down_weight"][e[n, k]].double() @ h)
    return out.view(x.shape)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_reference_is_the_per_token_formula(top_k: int, norm: bool, bias: bool) -> None:
    torch.manual_seed(top_k)
    p = moe_params(6, 24, 40, top_k, torch.float32, norm=norm, bias=bias)
    x = randn(2, 5, 24, dtype=torch.float32)
    got = get("moe", "reference")(x, **p)
    torch.testing.assert_close(got, per_token(x, p).float(), atol=1e-5, rtol=1e-5)


def test_router_bias_moves_tokens_to_favoured_experts() -> None:
    torch.manual_seed(0)
    p = moe_params(8, 32, 16, 2, torch.float32)
    x = randn(64, 32, dtype=torch.float32)
    bias = torch.zeros(8)
    bias[5] = 20.0
    _, plain = route(x, p["router_weight"], top_k=2, norm_topk_prob=True)
    _, biased = route(x, p["router_weight"], top_k=2, norm_topk_prob=True, router_bias=bias)
    assert (biased == 5).any(dim=-1).all() and not (plain == 5).any(dim=-1).all()


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "tokens", "experts", "top_k"),
    [
        (1, 1, 16, 1),  # decode of one token: 15 experts get nothing
        (1, 1, 8, 8),  # every expert, weights summing to 1
        (3, 7, 8, 2),  # Mixtral-like
        (2, 5, 12, 3),  # odd sizes
        (1, 33, 4, 1),
    ],
)
@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "no-norm-bias"])
def test_alternative_matches_reference(
    impl: str,
    dtype: torch.dtype,
    batch: int,
    tokens: int,
    experts: int,
    top_k: int,
    variant: str,
) -> None:
    torch.manual_seed(batch + 10 * tokens + experts + top_k)
    p = moe_params(
        experts,
        56,
        72,
        top_k,
        dtype,
        norm=variant != "no-norm-bias",
        round_weights=variant != "mixtral",
        bias=variant == "no-norm-bias",
    )
    x = randn(batch, tokens, 56, dtype=dtype)
    expected = get("moe", "reference")(x, **p)
    alt = get("moe", impl)
    actual = alt(x, **(alt.derived.fn(p) if alt.derived else p))
    assert expected.shape == (batch, tokens, 56)
    assert_close(actual, expected)


def test_experts_nobody_chose_are_not_needed() -> None:
    """A token routed by a huge bias to expert 0 only: NaN weights of the other experts must not
    reach the output of any implementation."""
    torch.manual_seed(3)
    p = moe_params(4, 16, 8, 1, torch.float32)
    p["router_bias"] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    clean = get("moe", "reference")(randn(1, 3, 16, dtype=torch.float32), **p)
    p["gate_up_weight"][1:] = float("nan")
    x = randn(1, 3, 16, dtype=torch.float32)
    for impl in ("reference", "gathered"):  # dense multiplies NaN by 0: NaN
        assert torch.isfinite(get("moe", impl)(x, **p)).all()
    assert clean.shape == (1, 3, 16)


# --------------------------------------------------------------------------- transformers' blocks
transformers = pytest.importorskip("transformers")


def hf_block(family: str, p: dict[str, Any], dtype: torch.dtype) -> Any:
    experts, hidden = p["router_weight"].shape
    inter = p["down_weight"].shape[-1]
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=p["top_k"],
            norm_topk_prob=p["norm_topk_prob"],
        )
        config._experts_implementation = "eager"
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(config)
    else:
        config = transformers.MixtralConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_local_experts=experts,
            num_experts_per_tok=p["top_k"],
        )
        config._experts_implementation = "eager"
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(config)
    block.gate.weight.data = p["router_weight"].clone()
    block.experts.gate_up_proj.data = p["gate_up_weight"].clone()
    block.experts.down_proj.data = p["down_weight"].clone()
    return block.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("family", "top_k", "norm"),
    [("qwen3_moe", 4, True), ("qwen3_moe", 2, False), ("mixtral", 2, True)],
)
def test_reference_is_transformers_sparse_moe_block(
    family: str, top_k: int, norm: bool, dtype: torch.dtype
) -> None:
    """Same weights, same inputs: equal to transformers' eager block — bit for bit in bfloat16
    on CPU (the router-weight rounding differs between the families and shows there), within
    float32 rounding in float32 (transformers 5.24 sums the experts in another order: 4e-8
    apart)."""
    torch.manual_seed(7)
    p = moe_params(8, 64, 48, top_k, dtype, norm=norm, round_weights=family == "qwen3_moe")
    x = randn(2, 9, 64, dtype=dtype)
    with torch.no_grad():
        want = hf_block(family, p, dtype)(x)
    got = get("moe", "reference")(x, **p)
    exact = dtype != torch.float32
    torch.testing.assert_close(got, want, atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5)


# ------------------------------------------------------------------ capturable, compilable
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", implementations("moe"))
def test_every_implementation_traces_as_one_graph(impl: str, dtype: torch.dtype) -> None:
    """``torch.compile(fullgraph=True)`` refuses a graph break, which is what a host
    synchronisation (``.item()``, ``.tolist()``) or a data-dependent shape causes: every
    implementation traces whole, so a CUDA graph can capture it and Inductor can compile it at
    a fixed batch. The traced function still computes the same as the eager one."""
    torch.manual_seed(7)
    p = moe_params(6, 32, 24, 2, dtype)
    x = randn(3, 1, 32, dtype=dtype)
    fn = get("moe", impl)
    torch._dynamo.reset()
    traced = torch.compile(lambda t: fn(t, **p), fullgraph=True, backend="eager")
    assert_close(traced(x), fn(x, **p))


def test_reference_adds_experts_in_increasing_id_like_transformers_loop() -> None:
    """bfloat16: the reference agrees with transformers' per-expert ``index_add_`` loop within
    rounding and is deterministic (the order itself: the next test)."""
    torch.manual_seed(11)
    p = moe_params(8, 32, 16, 3, torch.bfloat16)
    x = randn(5, 1, 32, dtype=torch.bfloat16)
    flat = x.reshape(-1, 32)
    w, e = route(flat, p["router_weight"], top_k=3, norm_topk_prob=True)
    w = w.to(torch.bfloat16)
    loop = torch.zeros_like(flat)
    for expert in range(8):  # transformers' order: experts ascending
        token, slot = torch.where(e == expert)
        gate, up = F.linear(flat[token], p["gate_up_weight"][expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, p["down_weight"][expert])
        loop.index_add_(0, token, (y * w[token, slot, None]).to(torch.bfloat16))
    got = get("moe", "reference")(x, **p)
    assert_close(got.reshape(-1, 32), loop)
    assert torch.equal(got, get("moe", "reference")(x, **p))


def test_gathered_products_run_in_chunks_that_bound_the_scratch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill of many tokens gathers its experts' weights a chunk of rows at a time; the
    result is the same as one gather."""
    from kiln.ops import moe

    torch.manual_seed(5)
    x, w = torch.randn(37, 16), torch.randn(6, 24, 16)
    experts = torch.randint(0, 6, (37,))
    whole = moe.gathered_linear(x, w, experts)
    monkeypatch.setattr(moe, "GATHER_BYTES", 5 * 24 * 16 * 4)  # five rows' weights a chunk
    chunked = moe.gathered_linear(x, w, experts)
    want = torch.stack([w[e] @ x[i] for i, e in enumerate(experts.tolist())])
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_over_many_tokens_runs_in_chunks_to_the_same_values(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    from kiln.ops import moe

    torch.manual_seed(6)
    p = moe_params(6, 24, 40, 2, dtype)
    x = randn(3, 7, 24, dtype=dtype)
    whole = moe.reference(x, **p)
    monkeypatch.setattr(moe, "CHUNK_TOKENS", 4)  # 21 tokens: 6 chunks, the last of one token
    chunked = moe.reference(x, **p)
    assert chunked.shape == x.shape and chunked.dtype == dtype
    # float32 products over fewer rows may round differently in the last bit (BLAS blocking)
    torch.testing.assert_close(chunked, whole, atol=1e-7, rtol=2e-6)


def test_dense_runs_the_reference_where_its_scratch_would_pass_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dense`` computes every expert on every token only while that scratch fits
    ``GATHER_BYTES`` (a prefill of a large MoE model ran the device out of memory): beyond it
    the step is the reference's, bit for bit; within it the result is ``dense``'s own."""
    from kiln.ops import moe

    torch.manual_seed(3)
    p = moe_params(6, 16, 12, 2, torch.float32)
    x = randn(2, 5, 16, dtype=torch.float32)
    own = get("moe", "dense")(x, **p)
    reference = get("moe", "reference")(x, **p)
    assert_close(own, reference)
    monkeypatch.setattr(moe, "GATHER_BYTES", 6 * 10 * (3 * 12 + 16) * 4 - 1)  # one byte short
    assert torch.equal(get("moe", "dense")(x, **p), reference)
    assert not torch.equal(own, reference)  # so the line above tells the two paths apart


def test_names_recipes_recorded_earlier_still_bind_but_are_not_offered() -> None:
    from kiln.agent_runner.space import op_dimensions

    for alias in ("grouped", "grouped_mm"):
        assert get("moe", alias).alias_of == "reference"
    moe_dim = next(d for d in op_dimensions("cuda") if d.op == "moe")
    assert "grouped" not in moe_dim.values and "grouped_mm" not in moe_dim.values
    assert {"gathered", "dense"} <= set(moe_dim.values)


def test_assignments_are_sorted_by_expert_and_combined_in_increasing_expert_id() -> None:
    """``sort_by_expert``: rows grouped by expert (``offsets`` their ends), and each token's
    choices land in its combine rows in increasing expert id (the order transformers' loop adds
    them in), one row each."""
    from kiln.ops.moe import sort_by_expert

    experts = torch.tensor([[5, 1, 3], [0, 5, 2], [3, 4, 1]])
    weights = torch.arange(9, dtype=torch.float32).view(3, 3)
    a = sort_by_expert(weights, experts, 6)
    assert a.experts.tolist() == sorted(experts.flatten().tolist())
    assert a.offsets.tolist() == [1, 3, 4, 6, 7, 9]
    assert sorted(a.dest.tolist()) == list(range(9))
    for row, (token, expert, weight) in enumerate(
        zip(a.token.tolist(), a.experts.tolist(), a.weights.tolist(), strict=True)
    ):
        slot = experts[token].tolist().index(expert)
        assert weight == weights[token, slot].item(), row
        rank = sorted(experts[token].tolist()).index(expert)
        assert a.dest[row].item() == token * 3 + rank, row
