"""Which dtypes a device computes natively, so an engine serves a model in its own dtype only
where that is fast, without importing torch (the service process resolves specs).

A CUDA device (compute capability 8.0+ for bfloat16, which every GPU kiln targets has) computes
bfloat16 and float16 natively. An x86 CPU does when its flags (``/proc/cpuinfo``) include a
bfloat16 dot product (``avx512_bf16``, Cooper Lake and later; ``amx_bf16``, Sapphire Rapids and
later) or a float16 one (``avx512_fp16``, ``amx_fp16``): oneDNN, which PyTorch uses for CPU
matmuls, dispatches to these instructions. Without them a bfloat16 matmul on CPU is emulated and
slower than float32, so float32 is chosen instead (Intel's ISA reference; oneDNN's "Data types"
documentation).
"""

from __future__ import annotations

import functools
from pathlib import Path

CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}
"""CPU flags of which any one makes the dtype native."""


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` is missing, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_native(dtype: str, device: str, flags: frozenset[str] | None = None) -> bool:
    """Whether ``device`` ("cpu", "cuda[:N]") computes ``dtype`` natively (float32 always).

    Args:
        flags: the CPU's flags; None = this host's (:func:`cpu_flags`).
    """
    if dtype == "float32" or device.startswith("cuda"):
        return True
    have = cpu_flags() if flags is None else flags
    return any(flag in have for flag in CPU_FLAGS.get(dtype, ()))
