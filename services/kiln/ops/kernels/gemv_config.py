"""Launch configurations of the matrix-vector kernels (:mod:`kiln.ops.kernels.gemv`,
:mod:`kiln.ops.kernels.norm_gemv`, :mod:`kiln.ops.kernels.qkv_rope`): :class:`GemvConfig`, and
:func:`default_config`, the rule that picks one from the problem's shape.

Triton is imported with this module (for ``cdiv`` and ``next_power_of_2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from kiln.ops.kernels.pdl import PDL_MODES

#: Streaming multiprocessors of the target (NVIDIA H200 SXM: 132 SMs), for default grid sizes.
DEFAULT_SMS = 132
#: Weight-tile elements per program kept in registers at 4 warps (``block_n * block_k``; 64
#: float32 registers per thread), the budget :func:`default_config` plans within.
TILE_BUDGET = 8192
SMALL_M = 4
"""Batches up to this use the measured small-batch launch rule of :func:`default_config`."""
SMALL_M_PROGRAMS = 2048
"""Programs the small-batch rule aims for (about 15 per SM of an H200's 132)."""


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
