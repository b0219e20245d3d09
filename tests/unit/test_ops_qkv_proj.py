"""``qkv_proj`` alternatives vs the reference (through their derived weight layouts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.ops.registry import get, implementations
from tests.unit.op_testing import DTYPES, assert_close, randn

# Alternatives that run on CPU and are exact (Triton kernels and lossy ones have their own tests).
ALTERNATIVES = [
    i
    for i in implementations("qkv_proj")
    if i != "reference" and get("qkv_proj", i).runs_on("cpu") and not get("qkv_proj", i).lossy
]
HIDDEN = 200
HEAD_DIM = 20
KV_HEADS = 2


def _params(group: int, bias: bool, dtype: torch.dtype) -> dict[str, Any]:
    hq = KV_HEADS * group
    params: dict[str, Any] = {"num_heads": hq, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    for name, heads in (("q", hq), ("k", KV_HEADS), ("v", KV_HEADS)):
        params[f"{name}_weight"] = randn(heads * HEAD_DIM, HIDDEN, dtype=dtype, scale=0.05)
        params[f"{name}_bias"] = randn(heads * HEAD_DIM, dtype=dtype) if bias else None
    return params


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_alternative_matches_reference(
    impl: str, dtype: torch.dtype, batch: int, tokens: int, group: int, bias: bool
) -> None:
    torch.manual_seed(batch + 10 * tokens + 100 * group)
    params = _params(group, bias, dtype)
    x = randn(batch, tokens, HIDDEN, dtype=dtype)
    expected = get("qkv_proj", "reference")(x, **params)
    alt = get("qkv_proj", impl)
    alt_params = alt.derived.fn(params) if alt.derived else params
    actual = alt(x, **alt_params)
    hq = KV_HEADS * group
    shapes = [(batch, hq, tokens, HEAD_DIM)] + [(batch, KV_HEADS, tokens, HEAD_DIM)] * 2
    assert [tuple(t.shape) for t in expected] == shapes
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e)
