"""Tensors over the sandbox's wire (:mod:`kiln.runtime.sandbox.wire`): a header
``{"dtype", "shape"}`` and the elements' bytes, row-major; nothing but these dtypes crosses.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.runtime.sandbox.wire import WireError

Tensor = torch.Tensor

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
"""dtype name -> dtype for every dtype that may cross."""


def tensor_header(t: Tensor) -> dict[str, Any]:
    """``{"dtype", "shape"}`` of ``t``."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def tensor_bytes(t: Tensor) -> bytes:
    """``t``'s elements, row-major, as bytes (copied to the host)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def from_bytes(meta: dict[str, Any], data: bytes | bytearray | memoryview) -> Tensor:
    """A new CPU tensor of ``meta``'s dtype and shape from ``data``.

    Raises:
        WireError: an unknown dtype, or a size that does not match.
    """
    dtype = DTYPES.get(str(meta.get("dtype")))
    shape = meta.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
        raise WireError(f"not a tensor header: {meta!r}"[:200])
    numel = 1
    for s in shape:
        numel *= s
    item = torch.empty((), dtype=dtype).element_size()
    if len(data) != numel * item:
        raise WireError(f"{len(data)} bytes for a {dtype} tensor of shape {shape}")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dtype == torch.bool:
        return raw.view(shape).to(torch.bool)
    return raw.view(dtype).view(shape)
