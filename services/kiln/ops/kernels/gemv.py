"""Matrix-vector products for small-batch decode (``x[M, K] @ weight[N, K].T``, ``M <= 16``; design:
docs/design/kernels.md, "GEMV").

A program owns ``block_n`` weight rows, streams ``[block_n, block_k]`` tiles along K and multiplies
each with all M rows of ``x``: the weight is read once whatever M. float32 accumulation; ``split_k >
1`` splits K over programs that ``atomic_add`` into a workspace, finished by a second kernel. The
same K loop carries :mod:`kiln.ops.kernels.norm_gemv`'s RMSNorm prologue and SiLU·mul epilogue.
Rounding mirrors kiln's PyTorch ops (linear rounded to the model dtype, each elementwise op in
float32 then rounded). Tiles: :mod:`kiln.ops.kernels.gemv_tiles`; launch configs:
:mod:`kiln.ops.kernels.gemv_config`. Imports Triton: import lazily, and set ``TRITON_INTERPRET=1``
before Triton's first import on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.gemv_config import GemvConfig, default_config
from kiln.ops.kernels.gemv_tiles import _gemv_tiles, _round, _silu_mul
from kiln.ops.kernels.pdl import launch_mode, pdl_enter, pdl_options

Tensor = torch.Tensor

#: Largest batch (rows of ``x``) the kernels take; each program loops over the rows statically.
MAX_M = 16
#: Float dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FINALIZE_BLOCK = 1024
_NORM_BLOCK_ELEMS = 4096

#: Tests set this True to have every internally allocated output start as NaN (so an element
#: the kernel forgets to write cannot pass as correct). Costs a fill per call; keep False.
POISON_OUTPUTS = False

# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _gemv_kernel(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_wn,
    nw_ptr,
    eps,
    bias_ptr,
    res_ptr,
    stride_rm,
    out_ptr,
    stride_om,
    ws_ptr,
    stride_wsm,
    N,
    K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(i, s)``: output columns ``i*BLOCK_N ..`` (of N; with ``SILU_MUL`` the weight
    has 2N rows: gate rows n, up rows N + n), K range ``[s*K_PER_SPLIT, (s+1)*K_PER_SPLIT)``.
    Without ``SPLIT`` it writes ``out[:M]``; with it, float32 partials into ``ws`` (``[M, N]``,
    or ``[M, 2N]`` gate|up) for :func:`_finalize_kernel`.
    """
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo = pid_k * K_PER_SPLIT
    acc_a, acc_b = _gemv_tiles(
        x_ptr, stride_xm, w_ptr, stride_wn, offs_n, offs_n + N, n_mask, k_lo, K_PER_SPLIT, K,
        nw_ptr, eps, M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, HAS_NORM, SILU_MUL, EMULATE_RNE, PDL,
    )  # fmt: skip
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    if SPLIT:
        ws = ws_ptr + offs_m[:, None] * stride_wsm + offs_n[None, :]
        tl.atomic_add(ws, acc_a, mask=mask)
        if SILU_MUL:
            tl.atomic_add(ws + N, acc_b, mask=mask)
    else:
        if SILU_MUL:
            y = _silu_mul(
                _round(acc_a, DTYPE, EMULATE_RNE),
                _round(acc_b, DTYPE, EMULATE_RNE),
                DTYPE,
                EMULATE_RNE,
            )
        else:
            if HAS_BIAS:
                acc_a += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            y = _round(acc_a, DTYPE, EMULATE_RNE)
            if HAS_RES:
                r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask)
                y = _round(y + r.to(tl.float32), DTYPE, EMULATE_RNE)
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finalize_kernel(
    ws_ptr,
    stride_wsm,
    bias_ptr,
    res_ptr,
    stride_rm,
    out_ptr,
    stride_om,
    N,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split-K epilogue, program ``(m, j)``: ``out[m, j*BLOCK ..]`` from the float32 workspace
    (bias, rounding to DTYPE, residual; or SiLU-and-multiply of its gate|up halves).
    """
    pdl_enter(PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(ws_ptr + m * stride_wsm + offs, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(ws_ptr + m * stride_wsm + N + offs, mask=mask, other=0.0)
        y = _silu_mul(
            _round(acc, DTYPE, EMULATE_RNE), _round(up, DTYPE, EMULATE_RNE), DTYPE, EMULATE_RNE
        )
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _round(acc, DTYPE, EMULATE_RNE)
        if HAS_RES:
            r = tl.load(res_ptr + m * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
            y = _round(y + r, DTYPE, EMULATE_RNE)
    tl.store(out_ptr + m * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------- host side

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def check_interpreter() -> bool:
    """Whether kernels run under Triton's interpreter (``TRITON_INTERPRET=1``).

    Raises:
        kiln.ops.kernels.runtime.KernelUnavailableError: the variable is set but Triton was imported
            before it.
    """
    if not runtime.interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction) or not isinstance(
        _gemv_kernel, InterpretedFunction
    ):
        raise runtime.KernelUnavailableError(
            "TRITON_INTERPRET=1 was set after Triton (or kiln.ops.kernels.gemv) was imported; "
            "set it before the first import of triton in the process"
        )
    return True


def alloc_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An output buffer: ``torch.empty``, or NaN-filled when :data:`POISON_OUTPUTS` is set."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def check_x(x: Tensor, name: str = "x") -> Tensor:
    """Validate ``x [M, K]`` (``1 <= M <= MAX_M``, supported float dtype); returns it with unit
    stride along K (copied only if needed).

    Raises:
        ValueError: wrong rank, M out of range, or unsupported dtype.
    """
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"{name} has {x.shape[0]} rows; the GEMV kernels take 1..{MAX_M}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} not supported (supported: {DTYPES})")
    if x.shape[1] < 1:
        raise ValueError(f"{name} has an empty reduction dim")
    return x if x.stride(1) == 1 else x.contiguous()


def check_weight(weight: Tensor, x: Tensor, name: str = "weight") -> None:
    """Validate a ``[N, K]`` row-major weight against ``x [M, K]``.

    Raises:
        ValueError: wrong rank, K mismatch, dtype or device mismatch, or not contiguous.
    """
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{name} is {tuple(weight.shape)} but x has K={x.shape[1]} (expected [N, {x.shape[1]}])"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"{name} dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{name} is on {weight.device} but x is on {x.device}")
    if not weight.is_contiguous():
        raise ValueError(f"{name} must be contiguous row-major (call .contiguous() once)")


def check_vector(v: Tensor, length: int, x: Tensor, name: str) -> None:
    """Validate a ``[length]`` contiguous parameter vector in ``x``'s dtype and device.

    Raises:
        ValueError: wrong shape, dtype, device, or not contiguous.
    """
    if tuple(v.shape) != (length,):
        raise ValueError(f"{name} must be [{length}], got {tuple(v.shape)}")
    if v.dtype != x.dtype or v.device != x.device:
        raise ValueError(f"{name} must be {x.dtype} on {x.device}, got {v.dtype} on {v.device}")
    if not v.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def launch(
    x: Tensor,
    weight: Tensor,
    *,
    n_out: int,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    out_dtype: torch.dtype,
    config: GemvConfig,
) -> Tensor:
    """Run :func:`_gemv_kernel` (and :func:`_finalize_kernel` for ``split_k > 1``) on validated
    inputs: ``x [M, K]``, ``weight [n_out, K]`` (``[2 * n_out, K]`` with ``silu_mul``),
    ``norm_weight [K]``, ``bias [n_out]``, ``residual [M, n_out]`` or None; returns ``[M, n_out]``
    in ``out_dtype``.
    """
    m, k = x.shape
    interp = check_interpreter()
    split = min(config.split_k, triton.cdiv(k, config.block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no program without a chunk
    block_m = triton.next_power_of_2(m)
    block_r = max(16, min(triton.next_power_of_2(k), _NORM_BLOCK_ELEMS // block_m))
    out = alloc_output((m, n_out), out_dtype, x.device)
    ws = None
    if split > 1:
        ws = torch.zeros((m, n_out * (2 if silu_mul else 1)), dtype=torch.float32, device=x.device)
    dummy = x  # stands in for absent optional pointers (never dereferenced)
    pdl = launch_mode(config.pdl, x.device)
    grid = (triton.cdiv(n_out, config.block_n), split)
    _gemv_kernel[grid](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        dummy if norm_weight is None else norm_weight,
        float(eps),
        dummy if bias is None else bias,
        dummy if residual is None else residual,
        0 if residual is None else residual.stride(0),
        out,
        out.stride(0),
        out if ws is None else ws,
        0 if ws is None else ws.stride(0),
        n_out,
        k,
        k_per_split,
        M=m,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_R=block_r,
        HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        SPLIT=ws is not None,
        EMULATE_RNE=interp,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_options(pdl),
    )
    if ws is not None:
        _finalize_kernel[(m, triton.cdiv(n_out, _FINALIZE_BLOCK))](
            ws,
            ws.stride(0),
            dummy if bias is None else bias,
            dummy if residual is None else residual,
            0 if residual is None else residual.stride(0),
            out,
            out.stride(0),
            n_out,
            DTYPE=_TL_DTYPES[x.dtype],
            BLOCK=_FINALIZE_BLOCK,
            HAS_BIAS=bias is not None,
            HAS_RES=residual is not None,
            SILU_MUL=silu_mul,
            EMULATE_RNE=interp,
            PDL=pdl,
            num_warps=4,
            **pdl_options(pdl),
        )
    return out


def gemv(
    x: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
) -> Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` for a small batch, float32 accumulation.

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_M``, float32/float16/bfloat16.
        weight: ``[N, K]`` contiguous, ``x.dtype``, same device.
        bias: ``[N]`` in ``x.dtype`` or None; added in float32 before rounding.
        residual: ``[M, N]`` in ``x.dtype`` or None; added after the rounding to ``x.dtype``, the
            sum rounded again.
        out_dtype: result dtype (default ``x.dtype``); the value is rounded to ``x.dtype`` first
            (``float32`` gives ``F.linear(x, w).float()``).
        config: launch configuration (default :func:`default_config` ``(N, K, m=M)``).

    Returns:
        ``[M, N]`` in ``out_dtype``; a new tensor.

    Raises:
        ValueError: shape, dtype or device mismatches, or ``M > MAX_M``.
        kiln.ops.kernels.runtime.KernelUnavailableError: Triton cannot run on ``x.device``.
    """
    x = check_x(x)
    check_weight(weight, x)
    n = weight.shape[0]
    if bias is not None:
        check_vector(bias, n, x, "bias")
    if residual is not None:
        if tuple(residual.shape) != (x.shape[0], n):
            raise ValueError(f"residual must be [{x.shape[0]}, {n}], got {tuple(residual.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must be {x.dtype} on {x.device}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    if out_dtype is not None and out_dtype not in DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not supported (supported: {DTYPES})")
    runtime.require(x.device)
    cfg = config or default_config(n, x.shape[1], m=x.shape[0])
    return launch(
        x,
        weight,
        n_out=n,
        bias=bias,
        residual=residual,
        out_dtype=out_dtype or x.dtype,
        config=cfg,
    )


def gemv_reference(
    x: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Plain PyTorch :func:`gemv`: ``F.linear(x, weight, bias)`` (rounded to ``x.dtype``),
    ``+ residual`` in ``x.dtype``, then cast to ``out_dtype`` (default ``x.dtype``).
    """
    y = torch.nn.functional.linear(x, weight, bias)
    if residual is not None:
        y = y + residual
    return y.to(out_dtype or x.dtype)
