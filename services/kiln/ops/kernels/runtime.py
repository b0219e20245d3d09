"""Whether Triton kernels can run on a device here.

Triton compiles for CUDA GPUs; with ``TRITON_INTERPRET=1`` (set before Triton is imported) it runs
kernels on CPU tensors through its interpreter instead: slow, for correctness tests on small
shapes only.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was asked to run where it cannot: Triton is not installed, or the tensors
    are on a CPU without ``TRITON_INTERPRET=1``."""


@functools.cache
def has_triton() -> bool:
    """True when the ``triton`` package is importable."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton's interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_run(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on tensors of ``device``: a CUDA device with Triton
    installed, or any device under the interpreter."""
    if not has_triton():
        return False
    kind = torch.device(device).type
    return kind == "cuda" or interpreting()


def require(device: torch.device | str) -> None:
    """Raise unless :func:`can_run` ``(device)``.

    Raises:
        KernelUnavailableError: with the reason.
    """
    if not has_triton():
        raise KernelUnavailableError("Triton is not installed (pip install 'kiln[kernels]')")
    if not can_run(device):
        raise KernelUnavailableError(
            f"Triton kernels need a CUDA device or TRITON_INTERPRET=1; tensors are on {device}"
        )


PDL_MODES = 3
"""Programmatic-dependent-launch modes a kernel config's ``pdl`` takes: 0 off, 1 wait then
release the next kernel, 2 release then wait (:mod:`kiln.ops.kernels.pdl`)."""


@functools.cache
def _pdl_capable(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    if major < 9:
        return False
    import triton.language as tl

    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


def pdl_available(device: torch.device | str) -> bool:
    """True when kernels launched on ``device`` can use programmatic dependent launch: compiled
    Triton (not the interpreter) with ``griddepcontrol`` support, on a CUDA device of compute
    capability >= 9.0 (Hopper; CUDA Programming Guide, "Programmatic Dependent Launch"). Kernels
    asked for PDL elsewhere launch the ordinary way."""
    dev = torch.device(device)
    if dev.type != "cuda" or interpreting() or not has_triton():
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _pdl_capable(index)
