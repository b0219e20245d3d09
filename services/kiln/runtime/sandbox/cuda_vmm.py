"""Device memory a process exports as a file descriptor and another maps, through the CUDA
driver's virtual memory management (``cuMemCreate`` with POSIX file-descriptor handles), over
ctypes (rationale: docs/design/engine.md, "Sandbox").

Legacy CUDA IPC (``cudaIpcOpenMemHandle``, what ``torch.multiprocessing`` uses) makes the
importer reach into the exporter through ``/proc/<pid>``, which a sandbox of another user in
a Landlock domain may not (the H200 answered "mapping of buffer object failed"). A descriptor
travels like any other (inherited, or over a Unix socket), and the importer chooses its access:
the sandbox maps the judge's weights read-only (a kernel writing them faults in the sandbox's
own context) and the output buffer read-write.

Every call raises :class:`CudaDriverError` naming the driver function and its error.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

_ALLOCATION_PINNED = 1
_HANDLE_POSIX_FD = 1
_LOCATION_DEVICE = 1
_GRANULARITY_RECOMMENDED = 1
ACCESS_READ = 1
ACCESS_READWRITE = 3


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (its name, code and the driver's text)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _call(name: str, *args: Any) -> None:
    lib = _cuda()
    code = getattr(lib, name)(*args)
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(text))
        what = text.value.decode() if text.value else "unknown error"
        raise CudaDriverError(f"{name} failed: CUDA driver error {code} ({what})")


def _current_context(device: int) -> None:
    """Make ``device``'s primary context (torch's) current on this thread."""
    torch.cuda.init()
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")  # the runtime makes the primary context current
    ctx = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(ctx))
    if not ctx.value:
        raise CudaDriverError("no current CUDA context after torch's initialisation")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.requestedHandleTypes = _HANDLE_POSIX_FD
    prop.location = _Location(_LOCATION_DEVICE, device)
    return prop


class _Cai:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at ``ptr`` (for ``torch.as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner  # kept alive by the tensor's deleter, which holds this object
        # not marked read-only here: the driver's access flags are what protect the memory
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


class DeviceMemory:
    """``nbytes`` (rounded up to the driver's granularity) of device memory mapped into this
    process: made exportable (:meth:`create`) or imported from a descriptor (:meth:`open`).

    Attributes:
        nbytes: the mapped size, bytes. fd: the exported descriptor (creator), else -1.
        tensor: the bytes as a 1-D ``torch.uint8`` tensor on the device (no copy).
    """

    def __init__(self, device: int, nbytes: int, handle: int, access: int, fd: int) -> None:
        self.device, self.nbytes, self.fd = device, nbytes, fd
        self._handle = ctypes.c_ulonglong(handle)
        self._ptr = ctypes.c_ulonglong(0)
        _call("cuMemAddressReserve", ctypes.byref(self._ptr), ctypes.c_size_t(nbytes),
              ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))  # fmt: skip
        _call("cuMemMap", self._ptr, ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
              self._handle, ctypes.c_ulonglong(0))  # fmt: skip
        desc = _AccessDesc(_Location(_LOCATION_DEVICE, device), access)
        _call("cuMemSetAccess", self._ptr, ctypes.c_size_t(nbytes), ctypes.byref(desc),
              ctypes.c_size_t(1))  # fmt: skip
        cai = _Cai(self._ptr.value, nbytes, self)
        self.tensor = torch.as_tensor(cai, device=f"cuda:{device}")
        if self.tensor.data_ptr() != self._ptr.value:
            raise CudaDriverError("torch copied the mapped memory instead of viewing it")

    @staticmethod
    def create(nbytes: int, device: int) -> DeviceMemory:
        """New device memory of at least ``nbytes`` on ``device``, exported as :attr:`fd`
        (close-on-exec; pass it to the sandbox with ``pass_fds``)."""
        _current_context(device)
        prop = _prop(device)
        granularity = ctypes.c_size_t(0)
        _call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop),
              ctypes.c_int(_GRANULARITY_RECOMMENDED))  # fmt: skip
        step = max(int(granularity.value), 1)
        size = max(step, -(-nbytes // step) * step)
        handle = ctypes.c_ulonglong(0)
        _call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
              ctypes.c_ulonglong(0))  # fmt: skip
        fd = ctypes.c_int(-1)
        _call("cuMemExportToShareableHandle", ctypes.byref(fd), handle,
              ctypes.c_int(_HANDLE_POSIX_FD), ctypes.c_ulonglong(0))  # fmt: skip
        os.set_inheritable(fd.value, False)
        return DeviceMemory(device, size, handle.value, ACCESS_READWRITE, fd.value)

    @staticmethod
    def open(fd: int, nbytes: int, device: int, *, writable: bool) -> DeviceMemory:
        """The memory exported as ``fd`` (``nbytes``, as created) mapped into this process,
        read-only unless ``writable``."""
        _current_context(device)
        handle = ctypes.c_ulonglong(0)
        _call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
              ctypes.c_int(_HANDLE_POSIX_FD))  # fmt: skip
        access = ACCESS_READWRITE if writable else ACCESS_READ
        return DeviceMemory(device, nbytes, handle.value, access, -1)
