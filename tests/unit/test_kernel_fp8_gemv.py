"""fp8 (e4m3, row-wise scales) GEMV kernel vs its reference, and the quantiser's properties,
through Triton's interpreter (``TRITON_INTERPRET=1`` set below before Triton is imported; see
tests/unit/kernel_testing.py). Triton 3.6's interpreter loads float8_e4m3fn correctly, so the
kernel itself runs here, not only under the gpu marker."""

from __future__ import annotations

import os
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from kiln.ops.kernels.fp8_gemv import (
    E4M3_MAX,
    dequantize_fp8_rowwise,
    fp8_gemv,
    fp8_gemv_reference,
    quantize_fp8_rowwise,
)
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

N, K = 333, 70  # not multiples of the blocks
SMALL: dict[str, Any] = {"block_n": 32, "block_k": 32, "num_warps": 2}


def test_quantize_rowwise_scale_and_error() -> None:
    torch.manual_seed(0)
    w = torch.randn(N, K) * torch.logspace(-3, 1, N)[:, None]
    w[7] = 0.0
    w8, scale = quantize_fp8_rowwise(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:7], w[:7].abs().amax(1) / E4M3_MAX)
    assert scale[7] > 0 and (w8[7].float() == 0).all()
    # Each row's largest element maps to +-448 exactly.
    assert (w8.float().abs().amax(1)[:7] == E4M3_MAX).all()
    # Round-to-nearest with 3 mantissa bits: relative error <= 2^-4 for normal values
    # (e4m3 normals start at 2^-6 times the scale).
    back = dequantize_fp8_rowwise(w8, scale, torch.float32)
    normal = w.abs() >= scale[:, None] * 2.0**-6
    rel = ((back - w).abs() / w.abs().clamp(min=1e-30))[normal]
    assert rel.max() <= 2.0**-4 + 1e-6
    assert rel.mean() > 1e-3  # it is lossy


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("use_dot", [None, True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(
    dtype: torch.dtype, rows: int, use_dot: bool | None, with_bias: bool
) -> None:
    torch.manual_seed(rows + 100 * with_bias)
    x = randn(rows, K, dtype=dtype)
    w8, scale = quantize_fp8_rowwise(randn(N, K, dtype=dtype, scale=0.05))
    bias = randn(N, dtype=dtype) if with_bias else None
    out = fp8_gemv(x, w8, scale, bias=bias, use_dot=use_dot, **SMALL)
    assert_finite(out)
    assert_close(out, fp8_gemv_reference(x, w8, scale, bias=bias))


def test_out_dtype() -> None:
    x = randn(2, K, dtype=torch.bfloat16)
    w8, scale = quantize_fp8_rowwise(randn(N, K, dtype=torch.float32))
    out = fp8_gemv(x, w8, scale, out_dtype=torch.float32, **SMALL)
    want = fp8_gemv_reference(x, w8, scale, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_error_vs_unquantized_is_a_few_percent() -> None:
    """The documented loss: 1-6 % relative (Frobenius) vs the bf16/fp32 weight's output."""
    torch.manual_seed(5)
    x = randn(4, K, dtype=torch.float32)
    w = randn(N, K, dtype=torch.float32, scale=0.05)
    w8, scale = quantize_fp8_rowwise(w)
    out = fp8_gemv(x, w8, scale, **SMALL)
    exact = F.linear(x, w)
    rel = float((out - exact).norm() / exact.norm())
    assert 0.01 < rel < 0.06, rel


def test_nan_output_never_passes() -> None:
    x = randn(1, K, dtype=torch.float32)
    w8, scale = quantize_fp8_rowwise(randn(N, K, dtype=torch.float32))
    out = fp8_gemv(x, w8, scale, **SMALL)
    out[0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(out, fp8_gemv_reference(x, w8, scale))


def test_bad_inputs_raise() -> None:
    x = randn(1, K, dtype=torch.float32)
    w8, scale = quantize_fp8_rowwise(randn(N, K, dtype=torch.float32))
    with pytest.raises(ValueError, match="float8"):
        fp8_gemv(x, w8.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemv(x, w8, scale[:-1])
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv(x, w8, scale, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_rowwise(torch.zeros(3))
