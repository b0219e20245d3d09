"""Float32 -> model-dtype casts that round the same under Triton's interpreter as on a GPU.

Compiled Triton casts float32 to bfloat16 round-to-nearest-even, as PyTorch does. Triton 3.6's
interpreter truncates instead (``triton/runtime/interpreter.py``, ``cast_impl`` passes no
rounding mode), so kernels tested on CPU would differ from the reference by an ulp. With
``EMULATE`` (set it to :func:`emulate_rounding` on the host) :func:`cast` rounds the float32 bits
itself first (the usual ``+0x7FFF + lsb`` trick; NaN and overflow to inf are not special-cased),
then the cast is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime


def emulate_rounding(dtype: torch.dtype) -> bool:
    """True when kernels must round float32 -> ``dtype`` by hand: bfloat16 under the
    interpreter."""
    return dtype == torch.bfloat16 and runtime.interpreting()


@triton.jit
def cast(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` (float32) cast to ``DTYPE``, round-to-nearest-even also under the interpreter."""
    if EMULATE:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
