"""Programmatic dependent launch (PDL) for kiln's Triton kernels.

A decode step at batch 1 is a chain of short kernels, and between two of them the GPU idles
while the first one's last programs drain and the second one launches (a few µs each, even in a
CUDA graph). On compute capability >= 9.0 a kernel launched with CUDA's programmatic stream
serialization attribute may start before the previous kernel in the stream has finished; its
programs run ``griddepcontrol.wait`` before touching anything the previous kernel writes, and
the previous kernel's ``griddepcontrol.launch_dependents`` says when the next one may launch
(PTX ISA, "griddepcontrol"; CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"). kiln's matrix-vector kernels issue their first weight loads before the wait:
weights are never written by a previous kernel, so they stream while that kernel finishes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime

PDL_MODES = runtime.PDL_MODES


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch, at the point where a program has issued every load that
    does not depend on the previous kernel (PTX ``griddepcontrol``; CUDA Programming Guide,
    "Programmatic Dependent Launch and Synchronization"). ``PDL`` 0: nothing (ordinary launch).
    1: wait until the previous kernel in the stream has finished and its writes are visible,
    then allow the next kernel to launch. 2: allow the next kernel to launch, then wait. The
    host must launch the kernel with ``launch_pdl=True`` for 1 and 2 (:func:`pdl_options`)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_options(pdl: int) -> dict[str, bool]:
    """Launch options for a kernel compiled with ``PDL=pdl``: ``{"launch_pdl": True}`` when
    ``pdl`` is on (Triton then launches it with CUDA's programmatic stream serialization
    attribute, which stream capture keeps as a programmatic edge of a CUDA graph), else none
    (the interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


def launch_mode(pdl: int, device: torch.device) -> int:
    """The PDL mode to compile and launch with: ``pdl`` where
    :func:`kiln.ops.kernels.runtime.pdl_available` ``(device)``, else 0 (the interpreter, CPUs
    and GPUs before Hopper launch the ordinary way).

    Raises:
        ValueError: ``pdl`` not in ``range(PDL_MODES)``.
    """
    if pdl not in range(PDL_MODES):
        raise ValueError(f"pdl must be 0, 1 or 2, got {pdl}")
    return pdl if pdl and runtime.pdl_available(device) else 0
