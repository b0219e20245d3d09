"""RMS norm fused into the GEMV that consumes it, and the gate/up GEMV with a SiLU·mul epilogue
(design: docs/design/kernels.md, "GEMV"). Rounding follows kiln's ``rms_norm``, ``F.linear``
and ``F.silu(gate) * up`` references, each op rounded to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import rms_norm as rms_norm_op
from kiln.ops.kernels import runtime
from kiln.ops.kernels.gemv import check_vector, check_weight, check_x
from kiln.ops.kernels.gemv import launch as _launch
from kiln.ops.kernels.gemv_config import GemvConfig, default_config

Tensor = torch.Tensor

#: Epilogues :func:`rms_norm_gemv` takes (None: plain projection).
ACTIVATIONS = (None, "silu_mul")


def _out_rows(weight: Tensor, activation: str | None) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    n = weight.shape[0]
    if activation == "silu_mul":
        if n % 2:
            raise ValueError(f"silu_mul needs the fused [2I, K] gate_up weight; got {n} rows")
        return n // 2
    return n


def _fused(
    x: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    weight: Tensor,
    activation: str | None,
    config: GemvConfig | None,
) -> Tensor:
    x = check_x(x)
    check_weight(weight, x)
    n = _out_rows(weight, activation)
    if norm_weight is not None:
        check_vector(norm_weight, x.shape[1], x, "norm_weight")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
    runtime.require(x.device)
    silu = activation == "silu_mul"
    cfg = config or default_config(n, x.shape[1], m=x.shape[0], paired=silu)
    return _launch(
        x,
        weight,
        n_out=n,
        norm_weight=norm_weight,
        eps=eps,
        silu_mul=silu,
        out_dtype=x.dtype,
        config=cfg,
    )


def rms_norm_gemv(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    *,
    activation: str | None = None,
    config: GemvConfig | None = None,
) -> Tensor:
    """``rms_norm(x) @ weight.T`` in one kernel, optionally with the SwiGLU epilogue.

    Args:
        x: ``[M, K]`` (``1 <= M <= MAX_M``; float32/float16/bfloat16).
        norm_weight: ``[K]`` in ``x.dtype``; eps >= 0.
        weight: ``[N, K]`` contiguous, ``x.dtype``; with ``activation="silu_mul"`` the fused
            ``[2I, K]`` ``cat([gate, up])``.
        config: ``block_n`` counts output rows (gate/up row pairs); default from ``gemv_config``.

    Returns a new ``[M, N]`` (``[M, I]`` with ``silu_mul``) in ``x.dtype``.

    Raises:
        ValueError: mismatches, ``M > MAX_M``, an odd row count with ``silu_mul``, an unknown
            activation, a negative ``eps``.
        KernelUnavailableError: Triton cannot run on ``x.device``.
    """
    return _fused(x, norm_weight, eps, weight, activation, config)


def gate_up_silu(x: Tensor, gate_up_weight: Tensor, *, config: GemvConfig | None = None) -> Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` from the fused ``[2I, K]`` weight, no norm: ``[M, I]`` in
    ``x.dtype``. Raises as :func:`rms_norm_gemv`.
    """
    return _fused(x, None, 0.0, gate_up_weight, "silu_mul", config)


def _silu_mul_reference(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_gemv_reference(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    *,
    activation: str | None = None,
    config: GemvConfig | None = None,
) -> Tensor:
    """Plain PyTorch :func:`rms_norm_gemv` (``config`` ignored); ValueError as it."""
    del config
    _out_rows(weight, activation)
    normed, _ = rms_norm_op.reference(x, weight=norm_weight, eps=eps)
    h = F.linear(normed, weight)
    return _silu_mul_reference(h) if activation == "silu_mul" else h


def gate_up_silu_reference(
    x: Tensor, gate_up_weight: Tensor, *, config: GemvConfig | None = None
) -> Tensor:
    """Plain PyTorch :func:`gate_up_silu` (``config`` ignored)."""
    del config
    return _silu_mul_reference(F.linear(x, gate_up_weight))
