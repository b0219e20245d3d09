"""Fused residual add + RMSNorm kernel vs its reference (kiln's ``rms_norm`` formula), through
Triton's interpreter (``TRITON_INTERPRET=1`` set below before Triton is imported; see
tests/unit/kernel_testing.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kiln.ops import rms_norm
from kiln.ops.kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

EPS = 1e-6


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cols", [16, 100, 2048])
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference(dtype: torch.dtype, rows: int, cols: int, with_residual: bool) -> None:
    torch.manual_seed(rows * 10_000 + cols)
    x = randn(rows, cols, dtype=dtype, scale=3.0)
    residual = randn(rows, cols, dtype=dtype) if with_residual else None
    weight = randn(cols, dtype=dtype)
    normed, s = add_rms_norm(x, residual, weight, EPS)
    want_normed, want_s = add_rms_norm_reference(x, residual, weight, EPS)
    assert_finite(normed)
    assert_close(normed, want_normed)
    # The residual sum is one rounding of an exact sum: bit-equal (rounding emulated under the
    # interpreter, see kiln.ops.kernels.rounding).
    assert torch.equal(s, want_s)
    if residual is None:
        assert s is x


def test_reference_is_kilns_rms_norm_reference() -> None:
    torch.manual_seed(1)
    x, r = randn(2, 5, 24, dtype=torch.bfloat16), randn(2, 5, 24, dtype=torch.bfloat16)
    w = randn(24, dtype=torch.bfloat16)
    a = add_rms_norm_reference(x, r, w, EPS)
    b = rms_norm.reference(x, r, weight=w, eps=EPS)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_strided_rows_and_fp32_weight() -> None:
    """Rows of a wider buffer (row stride > N), and a float32 weight: the result dtype follows
    type promotion (bf16 normed * fp32 weight -> fp32), as in the reference."""
    torch.manual_seed(2)
    big = randn(3, 64, dtype=torch.bfloat16)
    x = big[:, :40]
    w = torch.randn(40)
    normed, s = add_rms_norm(x, x, w, EPS)
    want_normed, want_s = add_rms_norm_reference(x, x, w, EPS)
    assert normed.dtype == torch.float32
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
    assert torch.equal(s, want_s)


def test_nan_output_never_passes() -> None:
    x = randn(2, 32, dtype=torch.float32)
    w = torch.ones(32)
    normed, _ = add_rms_norm(x, None, w, EPS)
    normed[1, 5] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(normed, add_rms_norm_reference(x, None, w, EPS)[0])


def test_bad_inputs_raise() -> None:
    x = randn(2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(31), EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x.double(), torch.ones(32), EPS)
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        add_rms_norm(x[None], None, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(x.T, None, torch.ones(2), EPS)
