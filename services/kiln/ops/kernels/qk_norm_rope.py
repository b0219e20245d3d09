"""Per-head Q/K RMSNorm + RoPE + KV-cache write from a fused QKV product's output, in one kernel
(the decode chain's prologue when the product runs apart). q is returned normed and rotated; k
normed, rotated and written to the cache at the device-side position; v copied. Rounding follows
kiln's reference ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops import rms_norm as rms_norm_op
from kiln.ops.kernels import runtime
from kiln.ops.kernels.pdl import launch_mode, pdl_enter, pdl_options
from kiln.ops.kernels.rounding import cast, emulate_rounding

Tensor = torch.Tensor


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    stride_xb,
    qn_ptr,
    kn_ptr,
    eps,
    cos_ptr,
    sin_ptr,
    stride_cs,
    pos_ptr,
    q_ptr,
    stride_qb,
    kc_ptr,
    vc_ptr,
    stride_cb,
    stride_ch,
    stride_cp,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_QN: tl.constexpr,
    HAS_KN: tl.constexpr,
    EMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(b, h)``: head ``h`` of sequence ``b``."""
    DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HKV)
    is_v = h >= HQ + HKV
    pdl_enter(PDL)
    row = qkv_ptr + b * stride_xb + h * D
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_QN or HAS_KN:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        n1 = cast(x1 * rstd, DTYPE, EMULATE).to(tl.float32)
        n2 = cast(x2 * rstd, DTYPE, EMULATE).to(tl.float32)
        if HAS_QN:
            w1 = tl.load(qn_ptr + offs, mask=mask & is_q, other=1.0).to(tl.float32)
            w2 = tl.load(qn_ptr + HALF + offs, mask=mask & is_q, other=1.0).to(tl.float32)
            x1 = tl.where(is_q, cast(w1 * n1, DTYPE, EMULATE).to(tl.float32), x1)
            x2 = tl.where(is_q, cast(w2 * n2, DTYPE, EMULATE).to(tl.float32), x2)
        if HAS_KN:
            w1 = tl.load(kn_ptr + offs, mask=mask & is_k, other=1.0).to(tl.float32)
            w2 = tl.load(kn_ptr + HALF + offs, mask=mask & is_k, other=1.0).to(tl.float32)
            x1 = tl.where(is_k, cast(w1 * n1, DTYPE, EMULATE).to(tl.float32), x1)
            x2 = tl.where(is_k, cast(w2 * n2, DTYPE, EMULATE).to(tl.float32), x2)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    rope_mask = mask & (h < HQ + HKV)
    c = tl.load(cos_ptr + pos * stride_cs + offs, mask=rope_mask, other=1.0)
    s = tl.load(sin_ptr + pos * stride_cs + offs, mask=rope_mask, other=0.0)
    o1 = tl.where(is_v, x1, cast(x1 * c - x2 * s, DTYPE, EMULATE).to(tl.float32)).to(DTYPE)
    o2 = tl.where(is_v, x2, cast(x2 * c + x1 * s, DTYPE, EMULATE).to(tl.float32)).to(DTYPE)
    q_out = q_ptr + b * stride_qb + h * D + offs
    tl.store(q_out, o1, mask=mask & is_q)
    tl.store(q_out + HALF, o2, mask=mask & is_q)
    kv_head = tl.where(is_k, h - HQ, tl.where(is_v, h - HQ - HKV, 0)).to(tl.int64)
    c_off = b * stride_cb + kv_head * stride_ch + pos * stride_cp + offs
    tl.store(kc_ptr + c_off, o1, mask=mask & is_k)
    tl.store(kc_ptr + c_off + HALF, o2, mask=mask & is_k)
    tl.store(vc_ptr + c_off, o1, mask=mask & is_v)
    tl.store(vc_ptr + c_off + HALF, o2, mask=mask & is_v)


def check_rope_write(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Validate the arguments of a RoPE + KV-cache write of ``x [B, ...]``'s heads (even
    ``head_dim``, ``[P, D/2]`` float32 tables, ``[B]`` int64 positions, ``[>= B, Hkv, S, D]``
    contiguous caches in x's dtype, one device); ValueError naming the first mismatch.
    """
    if min(num_heads, num_kv_heads, head_dim) < 1 or head_dim % 2:
        raise ValueError(
            f"need positive head counts and an even head_dim, got Hq={num_heads}, "
            f"Hkv={num_kv_heads}, D={head_dim}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim // 2 or t.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [P, {head_dim // 2}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {x.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    b = x.shape[0]
    if tuple(positions.shape) != (b,) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [{b}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions must be on {x.device}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[1] != num_kv_heads or cache.shape[3] != head_dim:
            raise ValueError(
                f"{name} must be [max_batch, {num_kv_heads}, S, {head_dim}], "
                f"got {tuple(cache.shape)}"
            )
        if cache.shape[0] < b:
            raise ValueError(f"{name} holds {cache.shape[0]} sequences, the batch has {b}")
        if cache.dtype != x.dtype or cache.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _check(
    qkv: Tensor,
    norms: tuple[Tensor | None, Tensor | None],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [B, (Hq + 2*Hkv) * D = {width}] with unit stride along its last dim, "
            f"got {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    for name, w in zip(("q_norm", "k_norm"), norms, strict=True):
        if w is not None and (
            tuple(w.shape) != (head_dim,) or w.device != qkv.device or not w.is_contiguous()
        ):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] on {qkv.device}")


def qk_norm_rope(
    qkv: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pdl: int = 0,
) -> Tensor:
    """Q/K head norms (optional), RoPE of q and k, and the k/v cache write of one decode step.

    Args:
        qkv: ``[B, (Hq + 2*Hkv) * D]`` (model dtype), unit stride along the last dim.
        q_norm, k_norm: ``[D]`` per-head RMSNorm scales, or None.
        cos, sin: ``[P, D/2]`` float32.
        positions: ``[B]`` int64, each ``< P`` and ``< S`` (not checked).
        k_cache, v_cache: ``[max_batch, Hkv, S, D]`` contiguous; written at
            ``[b, :, positions[b], :]``.
        pdl: :mod:`kiln.ops.kernels.pdl` mode.

    Returns a new q ``[B, Hq, D]``. Raises ValueError on mismatches, KernelUnavailableError when
    Triton cannot run.
    """
    check_rope_write(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    _check(qkv, (q_norm, k_norm), num_heads, num_kv_heads, head_dim)
    runtime.require(qkv.device)
    b = qkv.shape[0]
    q = torch.empty((b, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if b == 0:
        return q
    mode = launch_mode(pdl, qkv.device)
    grid = (b, num_heads + 2 * num_kv_heads)
    _qk_norm_rope_kernel[grid](
        qkv,
        qkv.stride(0),
        qkv if q_norm is None else q_norm,
        qkv if k_norm is None else k_norm,
        float(eps),
        cos,
        sin,
        cos.stride(0),
        positions,
        q,
        q.stride(0),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=num_heads,
        HKV=num_kv_heads,
        D=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        HAS_QN=q_norm is not None,
        HAS_KN=k_norm is not None,
        EMULATE=emulate_rounding(qkv.dtype),
        PDL=mode,
        num_warps=1 if head_dim <= 128 else 2,
        **pdl_options(mode),
    )
    return q


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_write_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> Tensor:
    """Plain PyTorch RoPE of ``q [B, Hq, D]`` and ``k [B, Hkv, D]`` and the k/v cache write at
    ``positions [B]``; returns the rotated q.
    """
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, D/2]
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, positions] = _rotate(k, c, s)
    v_cache[rows, :, positions] = v
    return _rotate(q, c, s)


def qk_norm_rope_reference(
    qkv: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pdl: int = 0,
) -> Tensor:
    """Plain PyTorch :func:`qk_norm_rope`, same cache writes."""
    del pdl
    d = head_dim
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.unflatten(-1, (num_heads, d)), k.unflatten(-1, (num_kv_heads, d))
    if q_norm is not None:
        q = rms_norm_op.reference(q, weight=q_norm, eps=eps)[0]
    if k_norm is not None:
        k = rms_norm_op.reference(k, weight=k_norm, eps=eps)[0]
    v = v.unflatten(-1, (num_kv_heads, d))
    return rope_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache)
