"""The Triton GEMV op implementations (``kiln.ops.linear_triton``) against each op's reference,
through the registry and their derived weight layouts, at decode (GEMV path) and prefill
(fallback) shapes.

``kiln.ops.linear_triton`` is imported inside the tests, not at collection: other op test modules
parametrize over ``implementations(op)`` when collected, and should not pick these CUDA-only
implementations up through this module.

Sets ``TRITON_INTERPRET=1`` before Triton's first import on hosts without CUDA (see
``test_kernel_gemv``'s docstring).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from typing import Any

import pytest

import kiln.ops
from kiln.ops.kernels import gemv as G
from kiln.ops.registry import get
from tests.unit.op_testing import DTYPES, assert_close, randn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 40, 4, 2, 8, 36, 50
SHAPES = [(1, 1), (3, 1), (2, 3)]  # (B, T): T == 1 is the GEMV path, T > 1 the fallback

assert kiln.ops  # the references are registered by importing the package


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "POISON_OUTPUTS", True)


def _rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return randn(*shape, dtype=dtype, scale=scale).to(DEVICE)


def _compare(op: str, impl: str, args: tuple[torch.Tensor, ...], params: dict[str, Any]) -> Any:
    import kiln.ops.linear_triton  # noqa: F401  (registers the implementations, once)

    alt = get(op, impl)
    assert alt.devices == ("cuda",)
    expected = get(op)(*args, **params)
    actual = alt(*args, **(alt.derived.fn(params) if alt.derived else params))
    return actual, expected


def test_max_m_matches_the_kernels() -> None:
    from kiln.ops.linear_triton import MAX_M

    assert MAX_M == G.MAX_M


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "t"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_proj(dtype: torch.dtype, b: int, t: int, bias: bool) -> None:
    def w(rows: int) -> torch.Tensor:
        return _rand(rows, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)

    def bv(rows: int) -> torch.Tensor | None:
        return _rand(rows, dtype=dtype) if bias else None

    params = {
        "q_weight": w(HEADS * HEAD_DIM),
        "k_weight": w(KV_HEADS * HEAD_DIM),
        "v_weight": w(KV_HEADS * HEAD_DIM),
        "q_bias": bv(HEADS * HEAD_DIM),
        "k_bias": bv(KV_HEADS * HEAD_DIM),
        "v_bias": bv(KV_HEADS * HEAD_DIM),
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
    }
    actual, expected = _compare(
        "qkv_proj", "triton_gemv", (_rand(b, t, HIDDEN, dtype=dtype),), params
    )
    for a, e in zip(actual, expected, strict=True):
        assert not a.isnan().any()
        assert_close(a, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "t"), SHAPES)
def test_o_proj(dtype: torch.dtype, b: int, t: int) -> None:
    attn = _rand(b, HEADS, t, HEAD_DIM, dtype=dtype)
    params = {
        "weight": _rand(HIDDEN, HEADS * HEAD_DIM, dtype=dtype, scale=0.2),
        "bias": _rand(HIDDEN, dtype=dtype) if b == 3 else None,
    }
    actual, expected = _compare("o_proj", "triton_gemv", (attn,), params)
    assert actual.shape == (b, t, HIDDEN)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "t"), SHAPES)
def test_mlp(dtype: torch.dtype, b: int, t: int) -> None:
    params = {
        "gate_weight": _rand(INTER, HIDDEN, dtype=dtype, scale=0.15),
        "up_weight": _rand(INTER, HIDDEN, dtype=dtype, scale=0.15),
        "down_weight": _rand(HIDDEN, INTER, dtype=dtype, scale=0.15),
    }
    x = _rand(b, t, HIDDEN, dtype=dtype)
    actual, expected = _compare("mlp", "triton_gate_up", (x,), params)
    assert actual.shape == (b, t, HIDDEN)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, HIDDEN), (3, 1, HIDDEN), (2, 9, HIDDEN)])
def test_lm_head(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _rand(*shape, dtype=dtype)
    params = {"weight": _rand(VOCAB, HIDDEN, dtype=dtype, scale=0.2)}
    actual, expected = _compare("lm_head", "triton_gemv", (x,), params)
    assert actual.dtype == torch.float32
    assert actual.shape == (*shape[:-1], VOCAB)
    assert_close(actual, expected)


def test_registered_for_cuda_only() -> None:
    import kiln.ops.linear_triton  # noqa: F401

    for op, impl in [
        ("qkv_proj", "triton_gemv"),
        ("o_proj", "triton_gemv"),
        ("mlp", "triton_gate_up"),
        ("lm_head", "triton_gemv"),
    ]:
        entry = get(op, impl)
        assert entry.runs_on("cuda") and not entry.runs_on("cpu")
