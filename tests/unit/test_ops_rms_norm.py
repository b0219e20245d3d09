"""``rms_norm`` alternatives vs the reference, with and without the residual add."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.registry import get, implementations
from tests.unit.op_testing import DTYPES, assert_close, randn

ALTERNATIVES = [i for i in implementations("rms_norm") if i != "reference"]


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 200), (3, 7, 200), (3, 5, 7, 24)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_alternative_matches_reference(
    impl: str, dtype: torch.dtype, shape: tuple[int, ...], with_residual: bool
) -> None:
    torch.manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, scale=3.0)
    residual = randn(*shape, dtype=dtype) if with_residual else None
    weight = (1 + randn(shape[-1], dtype=torch.float32, scale=0.1)).to(dtype)
    normed, res = get("rms_norm", "reference")(x, residual, weight=weight, eps=1e-6)
    normed2, res2 = get("rms_norm", impl)(x, residual, weight=weight, eps=1e-6)
    assert_close(normed2, normed)
    assert_close(res2, res)


def test_reference_formula_and_residual_out() -> None:
    x = torch.tensor([[3.0, 4.0]])
    r = torch.tensor([[1.0, -2.0]])
    w = torch.tensor([1.0, 2.0])
    normed, res = get("rms_norm", "reference")(x, r, weight=w, eps=0.0)
    s = x + r  # [4, 2], rms = sqrt(10)
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(normed, s / 10**0.5 * w)
    normed, res = get("rms_norm", "reference")(x, weight=w, eps=0.0)
    assert res is x
