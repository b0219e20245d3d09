"""Device functions the matrix-vector kernels share (:mod:`kiln.ops.kernels.gemv`,
:mod:`kiln.ops.kernels.qkv_rope`): rounding like kiln's plain-PyTorch ops, the RMS-norm
statistics of ``x``'s rows, and the K loop (:func:`_gemv_tiles`) that reads each weight tile once
for every row of ``x``.

Rounding: under Triton's interpreter a float32 -> bfloat16 cast truncates instead of rounding to
nearest-even, so :func:`_round` rounds bfloat16 through an explicit bit trick there
(``EMULATE_RNE``); compiled kernels use the hardware conversion, which gives the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.kernels.pdl import pdl_enter


@triton.jit
def _round(y, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``y`` (float32) rounded to ``DTYPE`` and widened back to float32."""
    out = y
    if DTYPE == tl.bfloat16 and EMULATE_RNE:
        # Round to nearest even on the bit pattern (the interpreter's cast truncates); NaN kept.
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    elif DTYPE != tl.float32:
        out = y.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def _row_rstd(
    x_ptr, stride_xm, M, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr
):
    """``[BLOCK_M]`` float32 ``rsqrt(mean(x[m]**2) + eps)`` of the first M rows (kiln's
    ``rms_norm`` statistics; rows >= M give ``rsqrt(eps)``, unused)."""
    offs_m = tl.arange(0, BLOCK_M)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_R):
        offs_k = k0 + tl.arange(0, BLOCK_R)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        xv = xv.to(tl.float32)
        sumsq += tl.sum(xv * xv, axis=1)
    return 1.0 / tl.sqrt(sumsq / K + eps)


@triton.jit
def _chunk_fma(
    acc_a,
    acc_b,
    w_a,
    w_b,
    x_ptr,
    stride_xm,
    offs_k,
    k_mask,
    nw_ptr,
    rstd,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """``acc += x[:M, offs_k] @ w.T`` for one K chunk of loaded weight tiles (``w_b`` too when
    ``PAIRED``); ``x`` RMS-normed on the fly with ``rstd`` and ``nw_ptr`` when ``HAS_NORM``."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    wa = w_a.to(tl.float32)
    wb = w_b.to(tl.float32)
    if HAS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    for m in tl.static_range(M):
        xv = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            xv = _round(xv * r, DTYPE, EMULATE_RNE)
            xv = _round(nw * xv, DTYPE, EMULATE_RNE)
        hit = offs_m[:, None] == m
        acc_a += tl.where(hit, tl.sum(wa * xv[None, :], axis=1)[None, :], 0.0)
        if PAIRED:
            acc_b += tl.where(hit, tl.sum(wb * xv[None, :], axis=1)[None, :], 0.0)
    return acc_a, acc_b


@triton.jit
def _gemv_tiles(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_wn,
    rows_a,
    rows_b,
    row_mask,
    k_lo,
    K_LEN: tl.constexpr,
    K: tl.constexpr,
    nw_ptr,
    eps,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Float32 ``[BLOCK_M, BLOCK_N]`` partial products of ``x[:M, k_lo:k_lo + K_LEN]``
    (RMS-normed over all K with ``eps`` and ``nw_ptr`` when ``HAS_NORM``) with weight rows
    ``rows_a`` (and ``rows_b`` when ``PAIRED``; else the second result is zeros). Each weight
    tile is loaded once and used for every row of ``x``; columns at or past K are masked off.

    The first chunk's weight loads are issued before :func:`pdl_enter`, so under programmatic
    dependent launch they stream while the previous kernel finishes; ``x`` and the norm
    statistics are read after it."""
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    base_a = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn
    base_b = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w_mask = row_mask[:, None] & k_mask[None, :]
    w_a = tl.load(base_a + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    w_b = w_a
    if PAIRED:
        w_b = tl.load(
            base_b + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
        )
    pdl_enter(PDL)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_NORM:
        rstd = _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M, BLOCK_R)
    acc_a, acc_b = _chunk_fma(
        acc_a, acc_b, w_a, w_b, x_ptr, stride_xm, offs_k, k_mask, nw_ptr, rstd,
        M, BLOCK_M, HAS_NORM, PAIRED, EMULATE_RNE,
    )  # fmt: skip
    for k0 in range(BLOCK_K, K_LEN, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w_mask = row_mask[:, None] & k_mask[None, :]
        w_a = tl.load(
            base_a + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
        )
        if PAIRED:
            w_b = tl.load(
                base_b + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
        acc_a, acc_b = _chunk_fma(
            acc_a, acc_b, w_a, w_b, x_ptr, stride_xm, offs_k, k_mask, nw_ptr, rstd,
            M, BLOCK_M, HAS_NORM, PAIRED, EMULATE_RNE,
        )  # fmt: skip
    return acc_a, acc_b


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``silu(gate) * up`` with torch's rounding: inputs already rounded to DTYPE, SiLU computed
    in float32 as ``x / (1 + exp(-x))`` and rounded, then the product rounded."""
    s = _round(gate / (1.0 + tl.exp(-gate)), DTYPE, EMULATE_RNE)
    return _round(s * up, DTYPE, EMULATE_RNE)
