"""Residual add and RMSNorm in one Triton kernel (vLLM's ``fused_add_rms_norm``, out of place).

One program per row reads ``x`` and ``residual`` once and writes ``s = x + residual`` and ``weight *
rmsnorm(s)``. Rounding follows kiln's ``rms_norm`` reference (:mod:`kiln.ops.rms_norm`): the sum
rounded to the model dtype, float32 statistics, the normalised row rounded to the model dtype before
the scale multiply. On CPU import only after setting ``TRITON_INTERPRET``
(:mod:`kiln.ops.kernels.runtime`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.rounding import cast, emulate_rounding

Tensor = torch.Tensor


@triton.jit
def _add_rms_norm(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMULATE_X: tl.constexpr,
    EMULATE_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Add in float32, round once to the model dtype: what ATen does for bf16 + bf16.
        s = cast(s.to(tl.float32) + r.to(tl.float32), sum_ptr.dtype.element_ty, EMULATE_X)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
    h = s.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=0) / n_cols
    normed = cast(h * tl.rsqrt(mean_sq + eps), x_ptr.dtype.element_ty, EMULATE_X)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast(w * normed.to(tl.float32), out_ptr.dtype.element_ty, EMULATE_OUT)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _rows(t: Tensor, name: str) -> Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    return t


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    *,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` (model dtype) and ``weight * rmsnorm(s)``, in one kernel.

    Args:
        x: ``[M, N]`` (model dtype), last dim contiguous (rows may be strided).
        residual: ``[M, N]`` in x's dtype, or None (then ``s`` is ``x`` itself).
        weight: ``[N]``.
        eps: added to the mean square (the config's ``rms_norm_eps``).
        num_warps: warps per row program; None picks 4 up to N = 2048 elements, 8 above.

    Returns:
        ``(normed [M, N], s [M, N])``: normed in ``torch.result_type(weight, x)`` (the
        reference's ``weight * h.to(x.dtype)``), s in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
        KernelUnavailableError: no CUDA device and no ``TRITON_INTERPRET=1``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, N], got {tuple(x.shape)}")
    m, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    for t in (weight, residual):
        if t is not None and t.device != x.device:
            raise ValueError(f"tensors on different devices: {x.device}, {t.device}")
    runtime.require(x.device)
    x = _rows(x, "x")
    weight = weight.contiguous()
    out = torch.empty((m, n), dtype=torch.result_type(weight, x), device=x.device)
    if residual is None:
        s, r = x, x
    else:
        r = _rows(residual, "residual")
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_n = triton.next_power_of_2(n)
    if m:
        _add_rms_norm[(m,)](
            x,
            r,
            weight,
            out,
            s,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            s.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=block_n,
            EMULATE_X=emulate_rounding(x.dtype),
            EMULATE_OUT=emulate_rounding(out.dtype),
            num_warps=num_warps or (4 if block_n <= 2048 else 8),
        )
    return out, s


def add_rms_norm_reference(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch :func:`add_rms_norm` (kiln's ``rms_norm`` reference formula); same
    arguments and results."""
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s
