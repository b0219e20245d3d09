"""Launch configurations of the matrix-vector kernels (:mod:`kiln.ops.kernels.gemv`,
:mod:`kiln.ops.kernels.norm_gemv`, :mod:`kiln.ops.kernels.qkv_rope`): :class:`GemvConfig`, and
:func:`default_config`, the rule that picks one from the problem's shape.

Triton is imported with this module (for ``cdiv`` and ``next_power_of_2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from kiln.ops.kernels import runtime
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
    """Launch configuration of a GEMV kernel (explicit, so calls are CUDA-graph capturable).

    Attributes:
        block_n: weight rows per program (power of two, 1..256; of each half for paired layouts).
        block_k: reduction chunk (power of two, 16..8192).
        split_k: programs along K (1..64, clamped to the chunks); > 1 adds float32 partials
            atomically, a second kernel finishes.
        num_warps: warps per program (power of two, 1..16).
        num_stages: pipelining depth of the K loop (1..8; default 1).
        pdl: programmatic dependent launch (:func:`kiln.ops.kernels.pdl.pdl_enter`; capability >=
            9.0, else ignored): 0 off; 1 and 2 load the first weight chunk, then wait for the
            previous kernel; 1 releases the next kernel after every program passed the wait, 2 once
            every program started.

    Raises:
        ValueError: a field out of range or not a power of two.
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
    """A launch configuration for ``n`` output rows (pairs when ``paired``), reduction length ``k``,
    batch ``m``.

    ``m <= SMALL_M``: measured best on an H200 (``benchmarks/fused_decode_profile.py --sweep``,
    Llama-3.2-1B; benchmarks/RESULTS.md): ``block_n`` the largest power of two <= 16 giving >=
    :data:`SMALL_M_PROGRAMS` programs, ``block_k = 16384 / (block_n * rows per output)`` in
    512..2048, no split (o_proj, down (1, 2048); gate_up (4, 2048); lm_head (16, 1024)). Larger
    ``m`` (not measured): ``block_n`` as above for ``2 * sms`` programs, ``block_k`` filling
    :data:`TILE_BUDGET`, tall-K shapes split to about ``2 * sms`` programs. Under Triton's
    interpreter (which costs per program, not per element): the fewest programs, no split.

    Raises:
        ValueError: ``n``, ``k`` or ``m`` not positive.
    """
    if n < 1 or k < 1 or m < 1:
        raise ValueError(f"default_config needs positive sizes, got n={n}, k={k}, m={m}")
    if runtime.interpreting():
        return GemvConfig(
            block_n=min(256, triton.next_power_of_2(n)),
            block_k=max(16, min(8192, triton.next_power_of_2(k))),
        )
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
