"""``mlp`` alternatives vs the reference (through their derived weight layouts)."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.registry import get, implementations
from tests.unit.op_testing import DTYPES, assert_close, randn

# Alternatives that run on CPU and are exact (Triton kernels and lossy ones have their own tests).
ALTERNATIVES = [
    i
    for i in implementations("mlp")
    if i != "reference" and get("mlp", i).runs_on("cpu") and not get("mlp", i).lossy
]


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(("hidden", "inter"), [(200, 344), (96, 1000)])
def test_alternative_matches_reference(
    impl: str, dtype: torch.dtype, batch: int, tokens: int, hidden: int, inter: int
) -> None:
    torch.manual_seed(batch + 10 * tokens + hidden)
    params = {
        "gate_weight": randn(inter, hidden, dtype=dtype, scale=0.07),
        "up_weight": randn(inter, hidden, dtype=dtype, scale=0.07),
        "down_weight": randn(hidden, inter, dtype=dtype, scale=0.05),
    }
    x = randn(batch, tokens, hidden, dtype=dtype)
    expected = get("mlp", "reference")(x, **params)
    alt = get("mlp", impl)
    actual = alt(x, **(alt.derived.fn(params) if alt.derived else params))
    assert expected.shape == (batch, tokens, hidden)
    assert_close(actual, expected)


def test_reference_is_swiglu() -> None:
    torch.manual_seed(0)
    g, u, d = torch.randn(5, 3), torch.randn(5, 3), torch.randn(3, 5)
    x = torch.randn(1, 2, 3)
    want = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    got = get("mlp", "reference")(x, gate_weight=g, up_weight=u, down_weight=d)
    torch.testing.assert_close(got, want)
