"""The devices of an engine pool, their kinds, and how an engine process is pinned to one.

A GPU engine process gets ``CUDA_VISIBLE_DEVICES`` set to that GPU alone and sees it as
``cuda:0``; a CPU engine gets ``""``. Devices come from ``KILN_ENGINE_DEVICES`` (else
``KILN_ENGINE_DEVICE``): ``auto`` (every visible GPU, else the CPU) or a comma list (``cuda`` =
every visible GPU). GPUs are listed with ``nvidia-smi`` or ``/proc``, never torch, so the service
holds no CUDA context. A GPU's kind comes from its name or ``KILN_ENGINE_DEVICE_KIND``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog

from kiln.engine_pool.settings import EngineSettings

log = structlog.get_logger("kiln.engine_pool")

CPU_KIND = "cpu"
UNKNOWN_GPU_KIND = "cuda"
"""Kind of a GPU whose name tells nothing (set ``KILN_ENGINE_DEVICE_KIND``)."""
NVIDIA_SMI_TIMEOUT_S = 10.0

_GPU_MODEL = re.compile(r"\b([abhlv]\d{2,3}[a-z]?|gb\d{3}|gh\d{3}|mi\d{3}[a-z]?)\b")
_KIND_JUNK = re.compile(r"[^a-z0-9_-]+")
_DEVICE = re.compile(r"^(cpu|cuda(?::(\d+))?)$")


class DeviceError(ValueError):
    """A device list that names no device, an unknown device, or a GPU that is not there."""


@dataclass(frozen=True)
class Gpu:
    """One visible NVIDIA GPU: ``index`` (``cuda:<index>`` here), ``pin`` (its UUID when known),
    name.
    """

    index: int
    pin: str
    name: str


@dataclass(frozen=True)
class Device:
    """One device engines run on: ``name`` (``"cpu"`` or ``"cuda:N"``), ``kind`` (the
    work-subject token), ``label`` and ``pin`` (its engines' ``CUDA_VISIBLE_DEVICES``, "" for the
    CPU).
    """

    name: str
    kind: str
    label: str = CPU_KIND
    pin: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def worker_device(self) -> str:
        """The device as the pinned engine process sees it: ``cuda:0`` or ``cpu``."""
        return "cuda:0" if self.is_cuda else CPU_KIND

    def env(self) -> dict[str, str]:
        """Environment variables of its engine processes (the pin)."""
        return {"CUDA_VISIBLE_DEVICES": self.pin}


CPU = Device(CPU_KIND, CPU_KIND)


def gpu_kind(name: str) -> str:
    """The hardware kind of a GPU name: ``NVIDIA H200`` -> ``h200``; without a model number its
    lower-case slug (``rtx-4090``); empty: ``cuda``.
    """
    lower = name.lower()
    m = _GPU_MODEL.search(lower)
    if m:
        return m.group(1)
    words = [w for w in lower.replace("nvidia", " ").replace("geforce", " ").split() if w]
    slug = _KIND_JUNK.sub("-", "-".join(words)).strip("-_")[:64]
    return slug or UNKNOWN_GPU_KIND


def _from_nvidia_smi() -> list[tuple[str, str]] | None:
    """(UUID, name) of every GPU in PCI order, or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=uuid,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("devices.nvidia_smi_failed", error=str(exc))
        return None
    rows = []
    for line in out.splitlines():
        uuid, _, name = line.partition(",")
        if uuid.strip():
            rows.append((uuid.strip(), name.strip()))
    return rows


def _from_proc(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[tuple[str, str]] | None:
    """(UUID, name) of every GPU from the driver's /proc files (sorted by bus id), or None."""
    if not root.is_dir():
        return None
    rows = []
    for info in sorted(root.glob("*/information")):
        fields: dict[str, str] = {}
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        rows.append((fields.get("GPU UUID", ""), fields.get("Model", "")))
    return rows


def visible_gpus(environ: dict[str, str] | None = None) -> list[Gpu]:
    """The GPUs this process may use, in ``cuda:N`` order, narrowed by ``CUDA_VISIBLE_DEVICES``
    of ``environ`` (default this process's).
    """
    env = os.environ if environ is None else environ
    rows = _from_nvidia_smi()
    if rows is None:
        rows = _from_proc()
    rows = rows or []
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        chosen = rows
    else:
        chosen = []
        for token in (t.strip() for t in mask.split(",")):
            if not token or token.startswith("-"):
                break  # CUDA stops at the first invalid entry
            if token.isdigit():
                if int(token) >= len(rows):
                    break
                chosen.append(rows[int(token)])
                continue
            match = [r for r in rows if r[0].startswith(token)]
            if not match:
                chosen.append((token, ""))  # a MIG instance or a GPU we could not list
                continue
            chosen.append(match[0])
    return [Gpu(i, uuid, name) for i, (uuid, name) in enumerate(chosen)]


def _gpu_device(gpu: Gpu, kind: str) -> Device:
    return Device(f"cuda:{gpu.index}", kind or gpu_kind(gpu.name), gpu.name or "cuda", gpu.pin)


def resolve_devices(settings: EngineSettings, gpus: list[Gpu] | None = None) -> list[Device]:
    """The devices of a pool under ``settings`` (``gpus`` default :func:`visible_gpus`).

    Raises:
        DeviceError: an unknown device, a CUDA device not visible, one named twice, or ``cuda``
            with no GPU.
    """
    spec = settings.devices.strip()
    if not spec:
        spec = settings.device if "device" in settings.model_fields_set else "auto"
    kind = settings.device_kind.strip().lower()
    names = [t.strip().lower() for t in spec.split(",") if t.strip()]
    if names == ["auto"]:
        found = visible_gpus() if gpus is None else gpus
        return [_gpu_device(g, kind) for g in found] or [CPU]
    devices: list[Device] = []
    for name in names:
        m = _DEVICE.match(name)
        if m is None:
            raise DeviceError(f"unknown device {name!r}: expected auto, cpu, cuda or cuda:N")
        if name == CPU_KIND:
            devices.append(CPU)
            continue
        found = visible_gpus() if gpus is None else gpus
        if m.group(2) is None:
            if not found:
                raise DeviceError("device 'cuda' asks for every GPU, but none is visible")
            devices.extend(_gpu_device(g, kind) for g in found)
            continue
        index = int(m.group(2))
        if index < len(found):
            devices.append(_gpu_device(found[index], kind))
        elif not found:  # no way to list GPUs here: trust the name, pin by index
            devices.append(Device(name, kind or UNKNOWN_GPU_KIND, "cuda", str(index)))
        else:
            raise DeviceError(f"device {name!r} is not visible: {len(found)} GPU(s) here")
    seen = [d.name for d in devices]
    if len(set(seen)) != len(seen) or not devices:
        raise DeviceError(f"devices {spec!r}: each device once, at least one")
    return devices


def settings_for(settings: EngineSettings, devices: list[Device]) -> EngineSettings:
    """``settings`` rebuilt with ``device=cuda`` when the devices are GPUs but the device was
    left at its default, so the CUDA defaults apply.
    """
    if settings.device.startswith("cuda") or not any(d.is_cuda for d in devices):
        return settings
    values = {name: getattr(settings, name) for name in settings.model_fields_set}
    values["device"] = "cuda"
    return EngineSettings(**values)
