"""``rms_norm`` "triton": residual add and RMSNorm in one Triton kernel (CUDA only).

Wraps :func:`kiln.ops.kernels.add_rms_norm.add_rms_norm` for ``[M, N]`` or ``[..., N]`` inputs
(leading dims flattened). Same contract and rounding as :func:`kiln.ops.rms_norm.reference`.
The kernel module is imported on first call (see :mod:`kiln.ops.attention_triton` for why).
"""

from __future__ import annotations

import torch

from kiln.ops.registry import register

Tensor = torch.Tensor


@register("rms_norm", "triton", devices=("cuda",))
def triton_rms_norm(
    x: Tensor,
    residual: Tensor | None = None,
    *,
    weight: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)`` in one kernel.

    Args:
        x: ``[..., N]`` (model dtype). residual: same shape and dtype, or None.
        weight: ``[N]``. eps: added to the mean square.

    Returns:
        ``(normed [..., N], residual_out [..., N])``; ``residual_out`` is ``x`` itself when
        ``residual`` is None.

    Raises:
        ValueError: shapes that do not match. KernelUnavailableError: no CUDA device.
    """
    from kiln.ops.kernels.add_rms_norm import add_rms_norm

    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    n = x.shape[-1]
    flat_r = None if residual is None else residual.reshape(-1, n)
    normed, s = add_rms_norm(x.reshape(-1, n), flat_r, weight, eps)
    normed = normed.view(*x.shape[:-1], n)
    return normed, (x if residual is None else s.view(x.shape))
