"""Small-M GEMV on fp8 (e4m3) weights with one float32 scale per output row: lossy.

``scale[n] = max|W[n, :]| / 448``, ``W8 = round_e4m3(W / scale)``; the kernel accumulates
``x @ W8.T`` in float32, scales per column, then adds the bias. Each weight is off by up to 2^-4
relative. On CPU import only after setting ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.lm_head_argmax import MAX_ROWS, check_gemv_args
from kiln.ops.kernels.rounding import cast, emulate_rounding

Tensor = torch.Tensor

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest scale: an all-zero row quantises to zeros instead of dividing by 0.
MIN_SCALE = 1e-12


def quantize_fp8_rowwise(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise symmetric fp8 quantisation of a 2-D float ``weight [N, K]``: ``(w_fp8 [N, K]
    float8_e4m3fn, scale [N] float32)``, scale at least 1e-12. ValueError otherwise.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {tuple(weight.shape)}")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=MIN_SCALE)
    w8 = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return w8.contiguous(), scale.contiguous()


def dequantize_fp8_rowwise(w_fp8: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``(w_fp8.float() * scale[:, None]).to(dtype)``: ``[N, K]`` in ``dtype``."""
    return (w_fp8.float() * scale[:, None]).to(dtype)


@triton.jit
def _fp8_gemv(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + ks[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        cast(y, out_ptr.dtype.element_ty, EMULATE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def fp8_gemv(
    x: Tensor,
    w_fp8: Tensor,
    scale: Tensor,
    *,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    use_dot: bool | None = None,
) -> Tensor:
    """``x @ (w_fp8.float() * scale[:, None]).T + bias`` with a float32 accumulator.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, ``1 <= M <= 16``, contiguous last dim.
        w_fp8, scale: from :func:`quantize_fp8_rowwise`; bias: ``[N]`` or None.
        block_n, block_k: powers of two >= 16.
        use_dot: ``tl.dot`` (M padded to 16) or multiply-sum; None: sum for M <= 2.

    Returns ``[M, N]`` in ``out_dtype`` (default x's). Raises ValueError on bad shapes, dtypes,
    devices or blocks; KernelUnavailableError without CUDA or ``TRITON_INTERPRET=1``.
    """
    check_gemv_args(x, w_fp8, block_n=block_n, block_k=block_k, num_warps=num_warps)
    n = w_fp8.shape[0]
    if w_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w_fp8 must be torch.float8_e4m3fn, got {w_fp8.dtype}")
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be [{n}] float32, got {tuple(scale.shape)} {scale.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    runtime.require(x.device)
    m, k = x.shape
    dot = use_dot if use_dot is not None else m > 2
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    _fp8_gemv[(triton.cdiv(n, block_n),)](
        x,
        w_fp8,
        scale.contiguous(),
        scale if bias is None else bias.contiguous(),
        out,
        m,
        n,
        x.stride(0),
        w_fp8.stride(0),
        out.stride(0),
        K=k,
        HAS_BIAS=bias is not None,
        M_PAD=MAX_ROWS if dot else triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_DOT=dot,
        UPCAST=runtime.interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EMULATE=emulate_rounding(out.dtype),
        num_warps=num_warps,
    )
    return out


def fp8_gemv_reference(
    x: Tensor,
    w_fp8: Tensor,
    scale: Tensor,
    *,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Plain PyTorch :func:`fp8_gemv` (float32, rounded to ``out_dtype``), any M: ``[M, N]``."""
    y = x.float() @ (w_fp8.float() * scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
