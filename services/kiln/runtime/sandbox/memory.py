"""Memory the judge shares with its sandbox (rationale: docs/design/engine.md, "Sandbox").

- Weights (:class:`SharedWeights`). CPU: every weight is moved into one ``memfd`` the judge maps
  shared and read-write, then seals against writes through any later mapping or ``write``
  (``F_SEAL_FUTURE_WRITE``, size sealed too). The sandbox maps it private and copy-on-write
  (:func:`map_weights`): a write there lands in the sandbox's own pages and never in the judge's;
  :func:`written_kib` reads from ``/proc/<pid>/smaps`` whether it wrote any. CUDA: a copy of
  the weights in device memory exported as a file descriptor (:mod:`.cuda_vmm`), which the
  sandbox maps read-only; the judge's own weights are never in the sandbox's reach (they cost
  their size once more on the device, on the first code-module candidate).
- The output buffer (:class:`SharedBuffer`): bytes both sides map shared and writable (CPU: a
  memfd; CUDA: exported device memory), where the sandbox writes each call's output.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
from collections.abc import Iterable
from typing import Any

import torch

from kiln.runtime.sandbox.tensors import DTYPES
from kiln.workloads.weights import WeightStore

Tensor = torch.Tensor

ALIGN = 4096
"""Offset alignment of each weight in the memfd, bytes."""
F_SEAL_FUTURE_WRITE = 0x0010
"""Linux's seal against writes through mappings made, and ``write`` calls, after it is set."""
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE


def _unique(store: WeightStore) -> list[tuple[list[str], Tensor]]:
    """``(names, tensor)`` once per distinct tensor of ``store`` (tied names together)."""
    seen: dict[int, tuple[list[str], Tensor]] = {}
    for name, t in store.items():
        seen.setdefault(id(t), ([], t))[0].append(name)
    return list(seen.values())


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class SharedWeights:
    """A weight store's tensors in memory a sandbox can map (module docstring).

    On CPU the store's tensors are moved in place (``Tensor.set_``: every model and site holding
    them sees the new storage; data pointers change, so build this before recording any).

    Attributes:
        manifest: one entry per distinct tensor: ``names``, ``dtype``, ``shape``, ``offset``.
        fd: the sealed memfd (CPU) or the exported device memory (CUDA). nbytes: its size.
        cuda: whether the weights are on a CUDA device (then a copy, :mod:`.cuda_vmm`).
        name: the memfd's name (``kiln-weights-<random>``: how ``/proc/<pid>/smaps`` names it).
    """

    def __init__(self, store: WeightStore) -> None:
        tensors = _unique(store)
        self.manifest: list[dict[str, Any]] = []
        self.fd = -1
        self.nbytes = 0
        self.name = f"kiln-weights-{secrets.token_hex(6)}"
        self._map: mmap.mmap | None = None
        self._memory: Any = None
        devices = {t.device.type for _, t in tensors}
        if len(devices) > 1 or devices - {"cpu", "cuda"}:
            raise ValueError(f"weights on {sorted(devices)}: one device type expected")
        self.cuda = devices == {"cuda"}
        offset = 0
        for names, t in tensors:
            self.manifest.append({"names": names, **_meta(t), "offset": offset})
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.nbytes = max(offset, ALIGN)
        if self.cuda:
            from kiln.runtime.sandbox.cuda_vmm import DeviceMemory

            memory = self._memory = DeviceMemory.create(self.nbytes, _index(tensors[0][1].device))
            self.fd, self.nbytes = memory.fd, memory.nbytes
            with torch.no_grad():
                for entry, (_, t) in zip(self.manifest, tensors, strict=True):
                    _view(memory.tensor, entry).copy_(t)  # the judge keeps its own weights
            torch.cuda.synchronize(tensors[0][1].device)
            return
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        with torch.no_grad():
            for entry, (_, t) in zip(self.manifest, tensors, strict=True):
                view = _view(base, entry)
                view.copy_(t)
                t.set_(view)  # type: ignore[call-overload]
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)


def _meta(t: Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _view(base: Tensor, entry: dict[str, Any]) -> Tensor:
    dtype = DTYPES[entry["dtype"]]
    numel = 1
    for s in entry["shape"]:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    start = int(entry["offset"])
    return base[start : start + nbytes].view(dtype).view(entry["shape"])


def map_weights(
    manifest: Iterable[dict[str, Any]], fd: int, nbytes: int, *, device: torch.device
) -> tuple[WeightStore, object]:
    """The sandbox's side: a :class:`WeightStore` over the judge's weights (CPU: the memfd mapped
    private, copy-on-write; CUDA: the exported copy mapped read-only). Returns the store and
    the mapping, which must outlive it.
    """
    tensors: dict[str, Tensor] = {}
    entries = list(manifest)
    mapping: Any
    if device.type == "cuda":
        from kiln.runtime.sandbox.cuda_vmm import DeviceMemory

        mapping = DeviceMemory.open(fd, nbytes, _index(device), writable=False)
        base = mapping.tensor
    else:
        flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
        base = torch.frombuffer(mapping, dtype=torch.uint8)
    for entry in entries:
        t = _view(base, entry)
        for name in entry["names"]:  # the manifest names tied tensors together
            tensors[name] = t
    return WeightStore(tensors), mapping


class SharedBuffer:
    """``nbytes`` of memory on ``device`` both sides map (module docstring); :meth:`view` reads
    a tensor out of its start.

    Attributes:
        fd: the memfd (CPU) or the exported device memory (CUDA, :mod:`.cuda_vmm`).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self._map: mmap.mmap | None = None
        self._memory: Any = None
        if device.type == "cuda":
            from kiln.runtime.sandbox.cuda_vmm import DeviceMemory

            memory = self._memory = DeviceMemory.create(self.nbytes, _index(device))
            self.fd, self.nbytes, self.base = memory.fd, memory.nbytes, memory.tensor
            return
        self.fd = os.memfd_create("kiln-sandbox-out", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        self.base = torch.frombuffer(self._map, dtype=torch.uint8)

    @staticmethod
    def open(fd: int, nbytes: int, device: torch.device) -> Tensor:
        """The sandbox's side: the buffer's bytes as a uint8 tensor (writable)."""
        if device.type == "cuda":
            from kiln.runtime.sandbox.cuda_vmm import DeviceMemory

            return DeviceMemory.open(fd, nbytes, _index(device), writable=True).tensor
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        return torch.frombuffer(mapping, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, shape: list[int]) -> Tensor:
        """A tensor of ``dtype`` and ``shape`` over the buffer's first bytes; ValueError if it
        does not fit."""
        return fit(self.base, dtype, shape)


def fit(base: Tensor, dtype: torch.dtype, shape: list[int]) -> Tensor:
    """A ``dtype``/``shape`` tensor over the first bytes of the uint8 ``base``; ValueError when
    it does not fit."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > base.numel():
        raise ValueError(f"{nbytes} bytes do not fit the {base.numel()}-byte output buffer")
    return base[:nbytes].view(dtype).view(shape)


def written_kib(pid: int, name: str) -> tuple[int, str]:
    """KiB of ``pid``'s mappings of the memfd ``name`` that are its own copies (written pages of a
    private mapping), and a problem ("" if none): the mapping is gone, or ``smaps`` unreadable.
    Linux only.
    """
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as exc:
        return 0, f"cannot read the sandbox's memory map ({exc.strerror})"
    written, found, inside = 0, False, False
    for line in text.splitlines():
        first = line.split(maxsplit=1)[0] if line else ""
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = f"/memfd:{name} " in line + " "
            found = found or inside
        elif inside and first == "Anonymous:":  # a private mapping's copied (written) pages
            written += int(line.split()[1])
    return written, "" if found else "the sandbox no longer maps the weights"
