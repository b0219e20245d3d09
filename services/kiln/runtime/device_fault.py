"""Which crashes leave a CUDA context unusable (sticky errors), and where it happened.

The engine pool replaces an engine process after a device fault in the judge's own context
(:func:`is_device_fault`); a fault in a candidate's sandbox (another process, its own context)
replaces only the sandbox, and its error starts with :data:`SANDBOX_FAULT`.
"""

from __future__ import annotations

DEVICE_FAULT_MARKERS = (
    "CUDA error",
    "CUDA_ERROR_",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "cuDNN error",
    "device-side assert",
    "AcceleratorError",
    "an illegal memory access",
    "unspecified launch failure",
)
"""Error texts after which a CUDA context cannot be trusted (sticky errors): the process is
replaced.
"""

SANDBOX_FAULT = "device fault in the candidate's sandbox"
"""How the error of a crash in the sandbox's CUDA context begins (the judge's is intact)."""


def is_device_fault(error: str) -> bool:
    """Whether a crash's error text is a device fault of the judge's context
    (:data:`DEVICE_FAULT_MARKERS`, and not a :data:`SANDBOX_FAULT`)."""
    if error.startswith(SANDBOX_FAULT):
        return False
    return any(marker in error for marker in DEVICE_FAULT_MARKERS)
