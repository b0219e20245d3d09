"""Shared helpers for the op tests: per-dtype tolerances and seeded inputs."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16]

# Alternative vs reference, same inputs: float32 differs by summation order only; bfloat16 by
# one rounding of intermediates (ATen kernels keep float32 accumulators on CPU and GPU).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` equals ``expected`` within the dtype's tolerance (absolute and relative)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in float32 (dtype-independent values), cast to ``dtype``."""
    return (torch.randn(*shape) * scale).to(dtype)
