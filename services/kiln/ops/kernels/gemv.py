"""Matrix-vector products for small-batch decode (``x[M, K] @ weight[N, K].T``, ``M <= 16``).

At batch 1 every projection of a decoder is bandwidth-bound: the weight is read once and each
element feeds one multiply-add per batch row. A program therefore owns ``block_n`` weight rows,
streams them along K in ``[block_n, block_k]`` tiles (row-major weight, contiguous along K, so each
thread issues 16-byte loads), and multiplies each tile with *all* M rows of ``x`` before moving
on, so the weight is read exactly once whatever M is. Accumulation is float32 (``tl.sum`` over a
broadcast product; no ``tl.dot``: at M = 1 tensor cores only waste registers). With
``split_k > 1`` the K range is split over programs that ``atomic_add`` float32 partial sums into a
zeroed workspace and a small second kernel applies the epilogue.

The kernel also carries the prologue/epilogue options that :mod:`kiln.ops.kernels.norm_gemv`
exposes (RMS norm of ``x`` in the prologue; SiLU-and-multiply of paired gate/up rows in the
epilogue), so every GEMV flavour shares one K loop.

Rounding mirrors kiln's plain-PyTorch ops (``F.linear`` result rounded to the model dtype, then
each elementwise op rounded again, computed in float32 like ATen's "opmath"). Under Triton's
interpreter a float32 -> bfloat16 cast truncates instead of rounding to nearest-even, so the
kernels round bfloat16 through an explicit bit trick there (``EMULATE_RNE``); compiled kernels use
the hardware conversion (round-to-nearest-even), which gives the same values.

Triton is imported with this module: import it lazily (``kiln.ops.linear_triton`` does), and set
``TRITON_INTERPRET=1`` before Triton's first import when running on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.pdl import PDL_MODES, launch_mode, pdl_enter, pdl_options

Tensor = torch.Tensor

#: Largest batch (rows of ``x``) the kernels take; each program loops over the rows statically.
MAX_M = 16
#: Streaming multiprocessors of the target (NVIDIA H200 SXM: 132 SMs), for default grid sizes.
DEFAULT_SMS = 132
#: Weight-tile elements per program kept in registers at 4 warps (``block_n * block_k``; 64
#: float32 registers per thread), the budget :func:`default_config` plans within.
TILE_BUDGET = 8192
SMALL_M = 4
"""Batches up to this use the measured small-batch launch rule of :func:`default_config`."""
SMALL_M_PROGRAMS = 2048
"""Programs the small-batch rule aims for (about 15 per SM of an H200's 132)."""
#: Float dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FINALIZE_BLOCK = 1024
_NORM_BLOCK_ELEMS = 4096

#: Tests set this True to have every internally allocated output start as NaN (so an element
#: the kernel forgets to write cannot pass as correct). Costs a fill per call; keep False.
POISON_OUTPUTS = False


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of a GEMV kernel (explicit: no autotuning at call time, so calls
    are CUDA-graph capturable).

    Attributes:
        block_n: weight rows per program (power of two, 1..256). For the paired layouts
            (gate/up, RoPE) the program owns ``block_n`` rows of each half.
        block_k: reduction chunk per loop iteration (power of two, 16..8192; a multiple of 8 so
            bfloat16 loads are 16 bytes per thread).
        split_k: programs per output row block along K (1..64); >1 accumulates float32
            partials with ``atomic_add`` into a zeroed workspace, then a second kernel casts and
            applies the epilogue. Clamped to the number of ``block_k`` chunks.
        num_warps: warps per program (power of two, 1..16).
        num_stages: software-pipelining depth of the K loop (1..8). Default 1: the default
            configs cover K = 2048 in one chunk, and latency is hidden by the many resident
            programs; the benchmark sweeps it.
        pdl: programmatic dependent launch (CUDA compute capability >= 9.0; ignored where
            :func:`kiln.ops.kernels.runtime.pdl_available` is False). 0: off, an ordinary
            launch. 1 and 2: the kernel may start while the previous kernel in the stream is
            still running; each program first issues the loads of its first weight chunk
            (weights are never written by a previous kernel), then waits for the previous
            kernel (``griddepcontrol.wait``) before it reads anything else or writes anything.
            1 lets the *next* kernel launch once every program of this one has passed that
            wait; 2 lets it launch as soon as every program of this one has started. See
            :func:`kiln.ops.kernels.pdl.pdl_enter`.

    Raises:
        ValueError: a field out of range or not a power of two (the message names it).
    """

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    pdl: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("block_n", self.block_n, 1, 256, True),
            ("block_k", self.block_k, 16, 8192, True),
            ("split_k", self.split_k, 1, 64, False),
            ("num_warps", self.num_warps, 1, 16, True),
            ("num_stages", self.num_stages, 1, 8, False),
            ("pdl", self.pdl, 0, PDL_MODES - 1, False),
        ]
        for name, value, lo, hi, pow2 in checks:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"GemvConfig.{name} must be an int, got {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"GemvConfig.{name} must be in [{lo}, {hi}], got {value}")
            if pow2 and not _pow2(value):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")


def default_config(
    n: int, k: int, *, m: int = 1, paired: bool = False, sms: int = DEFAULT_SMS
) -> GemvConfig:
    """A launch configuration for ``n`` output rows (row *pairs* when ``paired``) and reduction
    length ``k`` at batch ``m``.

    At ``m <= SMALL_M`` (decode at small batch) the rule is the one measured best on an H200
    (``benchmarks/fused_decode_profile.py --sweep``, Llama-3.2-1B, each kernel family over all 16
    layers captured in a CUDA graph; benchmarks/RESULTS.md): many programs with thin tiles —
    ``block_n`` the largest power of two <= 16 that still gives at least
    :data:`SMALL_M_PROGRAMS` programs, ``block_k`` = ``16384 / (block_n * rows per output)``
    clamped to 512..2048 (and to ``next_power_of_2(k)``), no split. Llama-3.2-1B, (block_n,
    block_k): o_proj and down (2048 rows) -> (1, 2048); gate_up (8192 pairs) -> (4, 2048);
    lm_head (128256 rows) -> (16, 1024). Measured there: down 165 µs for 16 layers against 279
    with the earlier (4, 2048), o_proj 70 against 85.

    Larger ``m``: ``block_n`` the largest power of two <= 16 that still gives at least ``2 * sms``
    programs; ``block_k`` fills the register budget :data:`TILE_BUDGET` (halved for paired
    tiles and for ``m > 8``); ``split_k`` splits tall-K shapes whose row blocks alone give fewer
    than ``sms`` programs into about ``2 * sms`` (each split >= 256 long). Not measured.

    Raises:
        ValueError: ``n``, ``k`` or ``m`` not positive.
    """
    if n < 1 or k < 1 or m < 1:
        raise ValueError(f"default_config needs positive sizes, got n={n}, k={k}, m={m}")
    if m <= SMALL_M:
        block_n = 16
        while block_n > 1 and triton.cdiv(n, block_n) < SMALL_M_PROGRAMS:
            block_n //= 2
        rows = block_n * (2 if paired else 1)
        block_k = min(triton.next_power_of_2(k), max(512, min(2048, 16384 // rows)))
        return GemvConfig(block_n=block_n, block_k=max(16, block_k))
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    budget = TILE_BUDGET // (2 if paired else 1) // (2 if m > 8 else 1)
    block_k = max(16, min(triton.next_power_of_2(k), budget // block_n))
    programs = triton.cdiv(n, block_n)
    split_k = 1
    if programs < sms:  # too few row blocks: split K (each split at least 256 long)
        split_k = max(1, min(triton.cdiv(2 * sms, programs), k // 256, 64))
        if split_k > 1:
            block_k = max(16, min(block_k, triton.next_power_of_2(triton.cdiv(k, split_k))))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k)


# ----------------------------------------------------------------------------- device helpers


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
    or ``[M, 2N]`` gate|up) for :func:`_finalize_kernel`."""
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
    (bias, rounding to DTYPE, residual; or SiLU-and-multiply of its gate|up halves)."""
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
        kiln.ops.kernels.runtime.KernelUnavailableError: the variable is set but Triton was
            imported before it was (Triton decides at import which of its own functions are
            interpreted, and a mix fails deep inside a launch).
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
    """Validate a ``[M, K]`` activation (``1 <= M <= MAX_M``, a supported float dtype); returns
    it with unit stride along K (a copy only when it had none).

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
    inputs; the shared back end of :func:`gemv` and :mod:`kiln.ops.kernels.norm_gemv`.

    Args:
        x: ``[M, K]`` unit stride along K. weight: ``[n_out, K]`` (``[2 * n_out, K]`` with
            ``silu_mul``), contiguous. norm_weight: ``[K]`` or None (no norm).
        bias: ``[n_out]`` or None; residual: ``[M, n_out]`` (unit stride along N) or None.
        out_dtype: dtype of the returned ``[M, n_out]`` tensor.
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
        weight: ``[N, K]`` contiguous row-major, ``x.dtype``, same device.
        bias: ``[N]`` in ``x.dtype``, or None; added in float32 before the rounding.
        residual: ``[M, N]`` in ``x.dtype``, or None; added after the linear result is rounded
            to ``x.dtype`` (o_proj + residual of kiln's decoder), the sum rounded again.
        out_dtype: dtype of the result (default ``x.dtype``); the value is always rounded to
            ``x.dtype`` first, so ``out_dtype=torch.float32`` gives ``F.linear(x, w).float()``
            (kiln's ``lm_head``).
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
    ``+ residual`` in ``x.dtype``, then cast to ``out_dtype`` (default ``x.dtype``)."""
    y = torch.nn.functional.linear(x, weight, bias)
    if residual is not None:
        y = y + residual
    return y.to(out_dtype or x.dtype)
