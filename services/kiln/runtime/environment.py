"""The software and hardware an engine measures with, as strings (recorded with every
experiment in ``ExperimentCompleted.environment`` and in an export's manifest).

Keys: ``kiln``, ``python``, ``torch``, ``triton`` (when importable), ``cuda`` (the CUDA runtime
torch was built with, when any), ``gpu`` (the device's name on CUDA), ``device`` (the device
type). Imports torch lazily.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform

COMPARED_KEYS = ("kiln", "torch", "triton", "cuda", "gpu", "python")
"""Keys whose difference makes a reproduction suspect (:func:`differences`)."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str = "cpu") -> dict[str, str]:
    """Versions and device of this process for ``device`` (``"cpu"`` or ``"cuda[:N]"``); a new
    dict each call (computed once per device)."""
    return dict(_environment(device))


@functools.lru_cache(maxsize=8)
def _environment(device: str) -> tuple[tuple[str, str], ...]:
    import torch

    import kiln

    env = {
        "kiln": kiln.__version__,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "device": torch.device(device).type,
    }
    triton = _version("triton")
    if triton:
        env["triton"] = triton
    if torch.version.cuda:
        env["cuda"] = str(torch.version.cuda)
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(dev)
    return tuple(env.items())


def differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """The compared keys (:data:`COMPARED_KEYS`) whose values differ, as
    ``"torch 2.5.1 (recorded 2.4.0)"``; a key missing on one side counts when the other has
    it."""
    out = []
    for key in COMPARED_KEYS:
        a, b = recorded.get(key), current.get(key)
        if a != b and (a or b):
            out.append(f"{key} {b or 'absent'} (recorded {a or 'absent'})")
    return out
