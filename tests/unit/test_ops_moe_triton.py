"""``moe`` "triton_gather" and its kernels (:mod:`kiln.ops.kernels.moe_decode`) through Triton's
interpreter (``TRITON_INTERPRET=1`` set below before Triton is imported; see
tests/unit/kernel_testing.py): against the ``reference`` implementation per dtype, batch, top-k
and family; the kernels read only the routed experts; the fallback above the threshold; the
opaque custom op under ``torch.compile``."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kiln.ops  # noqa: F401
from kiln.ops import moe_triton
from kiln.ops.moe import route
from kiln.ops.registry import get
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

EXPERTS, HIDDEN, INTER = 8, 64, 32
VARIANTS = {  # norm_topk_prob, round_router_weights, router bias
    "qwen3-moe": (True, True, False),
    "mixtral": (False, False, False),
    "no-norm-bias": (False, True, True),
}


def params(top_k: int, dtype: torch.dtype, variant: str = "qwen3-moe") -> dict[str, Any]:
    norm, rounded, bias = VARIANTS[variant]
    return {
        "router_weight": randn(EXPERTS, HIDDEN, dtype=dtype, scale=0.3),
        "gate_up_weight": randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, scale=0.08),
        "down_weight": randn(EXPERTS, HIDDEN, INTER, dtype=dtype, scale=0.08),
        "top_k": top_k,
        "norm_topk_prob": norm,
        "round_router_weights": rounded,
        "router_bias": torch.linspace(2.0, -2.0, EXPERTS) if bias else None,
    }


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts calls of the kernel path (``moe_triton._experts``)."""
    calls: list[int] = []
    real = moe_triton._experts

    def spy(*args: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(moe_triton, "_experts", spy)
    yield calls


def test_registration_runs_on_cuda_only_lossless_and_capturable() -> None:
    impl = get("moe", "triton_gather")
    assert impl.runs_on("cuda") and not impl.runs_on("cpu")
    assert not impl.lossy and impl.capturable and impl.derived is None


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(
    dtype: torch.dtype, batch: int, top_k: int, variant: str, kernel_calls: list[int]
) -> None:
    torch.manual_seed(batch * 10 + top_k)
    p = params(top_k, dtype, variant)
    x = randn(batch, 1, HIDDEN, dtype=dtype)
    out = get("moe", "triton_gather")(x, **p)
    assert kernel_calls == [1]
    assert_close(out, get("moe", "reference")(x, **p))


@pytest.mark.parametrize("dtype", DTYPES)
def test_router_bias_and_prefill_shapes_match_reference(
    dtype: torch.dtype, kernel_calls: list[int]
) -> None:
    torch.manual_seed(4)
    p = params(3, dtype, "no-norm-bias")
    x = randn(2, 5, HIDDEN, dtype=dtype)  # [B, T, H] with T > 1: 30 assignments
    out = get("moe", "triton_gather")(x, **p)
    assert kernel_calls == [1]
    assert_close(out, get("moe", "reference")(x, **p))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("poisoned_empty")
def test_kernel_with_small_tiles_matches_its_reference(dtype: torch.dtype) -> None:
    """Odd sizes over several tiles of every block (masks on every edge), int32 ids; every
    output element written (scratch and output start as NaN)."""
    from kiln.ops.kernels.moe_decode import MoeDecodeConfig, moe_decode, moe_decode_reference

    torch.manual_seed(9)
    e, h, i, n, k = 5, 56, 72, 3, 2
    x = randn(n, h, dtype=dtype)
    gate_up = randn(e, 2 * i, h, dtype=dtype, scale=0.1)
    down = randn(e, h, i, dtype=dtype, scale=0.1)
    ids = torch.tensor([[4, 0], [2, 2], [1, 3]], dtype=torch.int32)
    wts = torch.rand(n, k)
    cfg = MoeDecodeConfig(block_i=16, block_h=32, block_o=16, block_r=32)
    out = moe_decode(x, ids, wts, gate_up, down, config=cfg)
    assert_finite(out)
    assert_close(out, moe_decode_reference(x, ids.long(), wts, gate_up, down))
    assert torch.equal(out, moe_decode(x, ids, wts, gate_up, down, config=cfg))  # deterministic


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_is_added_as_pytorch_adds_it(dtype: torch.dtype) -> None:
    """``residual=`` gives bit for bit ``residual + moe_decode(...)`` (the fused chain's add)."""
    from kiln.ops.kernels.moe_decode import MoeDecodeConfig, moe_decode

    torch.manual_seed(11)
    e, h, i, n, k = 6, 48, 40, 3, 3
    x = randn(n, h, dtype=dtype)
    gate_up = randn(e, 2 * i, h, dtype=dtype, scale=0.1)
    down = randn(e, h, i, dtype=dtype, scale=0.1)
    ids = torch.tensor([[5, 0, 2], [1, 1, 4], [3, 2, 0]])
    wts = torch.rand(n, k)
    residual = randn(n, h, dtype=dtype, scale=4.0)
    cfg = MoeDecodeConfig(block_i=16, block_h=16, block_o=16, block_r=16)
    alone = moe_decode(x, ids, wts, gate_up, down, config=cfg)
    fused = moe_decode(x, ids, wts, gate_up, down, residual=residual, config=cfg)
    assert torch.equal(fused, residual + alone)
    assert not torch.equal(fused, alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_residual_fuses_only_this_implementation(dtype: torch.dtype) -> None:
    """The fused chain's hook: a bound ``triton_gather`` gives ``residual + op(x)`` bit for bit;
    another implementation, a sigmoid router or a batch past the kernel's gets None."""
    import functools

    torch.manual_seed(12)
    p = params(2, dtype, "no-norm-bias")
    x = randn(3, HIDDEN, dtype=dtype)
    residual = randn(3, HIDDEN, dtype=dtype, scale=3.0)
    bound = functools.partial(get("moe", "triton_gather").fn, **p)  # as OpBinding.bind
    fused = moe_triton.with_residual(bound, x, residual)
    assert fused is not None
    assert torch.equal(fused, residual + bound(x[:, None, :])[:, 0])
    other = functools.partial(get("moe", "reference").fn, **p)
    assert moe_triton.with_residual(other, x, residual) is None
    sigmoid = functools.partial(get("moe", "triton_gather").fn, **p, scoring="sigmoid")
    assert moe_triton.with_residual(sigmoid, x, residual) is None
    big = randn(moe_triton.MAX_ASSIGNMENTS, HIDDEN, dtype=dtype)
    assert moe_triton.with_residual(bound, big, big) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_only_the_routed_experts(dtype: torch.dtype) -> None:
    """Every expert no token chose holds NaN weights: the output stays finite and unchanged."""
    torch.manual_seed(2)
    p = params(2, dtype)
    x = randn(3, 1, HIDDEN, dtype=dtype)
    _, experts = route(x.view(3, HIDDEN), p["router_weight"], top_k=2, norm_topk_prob=True)
    unused = sorted(set(range(EXPERTS)) - set(experts.flatten().tolist()))
    assert unused, "the case must leave some expert unused"
    clean = get("moe", "triton_gather")(x, **p)
    for name in ("gate_up_weight", "down_weight"):
        p[name] = p[name].clone()
        p[name][unused] = float("nan")
    out = get("moe", "triton_gather")(x, **p)
    assert_finite(out)
    assert torch.equal(out, clean)


def test_above_the_threshold_runs_the_reference(kernel_calls: list[int]) -> None:
    torch.manual_seed(6)
    p = params(8, torch.float32)
    fn = get("moe", "triton_gather")
    limit = moe_triton.MAX_ASSIGNMENTS // 8
    big = randn(limit + 1, 1, HIDDEN, dtype=torch.float32)
    assert torch.equal(fn(big, **p), get("moe", "reference")(big, **p))
    assert kernel_calls == []
    at = big[:limit]
    assert_close(fn(at, **p), get("moe", "reference")(at, **p))
    assert kernel_calls == [1]


def test_where_the_kernels_cannot_run_it_runs_the_reference(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    p = {
        k: v.to("meta") if isinstance(v, torch.Tensor) else v
        for k, v in params(2, torch.bfloat16).items()
    }
    x = torch.empty(2, 1, HIDDEN, dtype=torch.bfloat16, device="meta")
    assert get("moe", "triton_gather")(x, **p).shape == x.shape
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter
    cpu = params(2, torch.float32)
    y = randn(2, 1, HIDDEN, dtype=torch.float32)
    assert torch.equal(get("moe", "triton_gather")(y, **cpu), get("moe", "reference")(y, **cpu))
    assert kernel_calls == []


def test_under_torch_compile_the_kernels_are_an_opaque_op() -> None:
    torch.manual_seed(8)
    p = params(2, torch.float32)
    x = randn(3, 1, HIDDEN, dtype=torch.float32)
    fn = get("moe", "triton_gather")
    calls: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda t: fn(t, **p), backend=backend, fullgraph=True)(x)
    assert "kiln.moe_gather.default" in calls  # Dynamo never traced into the kernels
    assert "kiln.moe_route.default" in calls
    assert torch.equal(out, fn(x, **p))


def test_kernel_rejects_bad_inputs() -> None:
    from kiln.ops.kernels.moe_decode import MoeDecodeConfig, moe_decode

    x = randn(2, HIDDEN, dtype=torch.float32)
    gu = randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.float32)
    down = randn(EXPERTS, HIDDEN, INTER, dtype=torch.float32)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    wts = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"gate_up_weight must be torch\.bfloat16"):
        moe_decode(x.bfloat16(), ids, wts, gu, down)
    with pytest.raises(ValueError, match="not supported"):
        moe_decode(x.double(), ids, wts, gu.double(), down.double())
    with pytest.raises(ValueError, match="down_weight"):
        moe_decode(x, ids, wts, gu, down[:, :, :-1])
    with pytest.raises(ValueError, match="topk_weights"):
        moe_decode(x, ids, wts.double(), gu, down)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_decode(x, ids[:1], wts, gu, down)
    with pytest.raises(ValueError, match="power of two"):
        MoeDecodeConfig(block_o=12)
    with pytest.raises(ValueError, match="pdl"):
        MoeDecodeConfig(pdl=3)
    with pytest.raises(ValueError, match="residual"):
        moe_decode(x, ids, wts, gu, down, residual=x[:1])
    with pytest.raises(ValueError, match="residual"):
        moe_decode(x, ids, wts, gu, down, residual=x.double())
