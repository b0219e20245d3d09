"""Reading checkpoint tensors as published, block-FP8 and MXFP4 ones dequantized at load.

A :class:`CheckpointReader` opens a directory's ``*.safetensors`` and serves tensors by name in
the engine's compute dtype; ``quantization_config`` (``config.json``) says how they are stored:

- none: every tensor as stored, cast. A float8 tensor without a quantization config is refused
  (its scale would be ignored).
- ``quant_method: "fp8"`` (DeepSeek-V3, Kimi-K2, GLM-5-FP8, MiniMax-M2: transformers'
  ``FineGrainedFP8Config``): ``fmt`` ``e4m3`` (``float8_e4m3fn``), ``weight_block_size [bm, bn]``
  (default ``[128, 128]``), dynamic activation scaling. A weight stored as ``float8_e4m3fn`` has a
  float32 ``<name>_scale_inv`` of shape ``[..., ceil(out / bm), ceil(in / bn)]`` and is
  ``W = fp8.float() * scale_inv`` broadcast over each ``bm x bn`` block (edge blocks partial).
  Tensors stored otherwise (norms, routers, embeddings, ``modules_to_not_convert``) are read as
  stored.
- ``quant_method: "mxfp4"`` (gpt-oss; OCP Microscaling FP4): a weight ``<name>`` is stored as
  ``<name>_blocks`` (uint8 ``[..., rows, G, 16]``: 32 FP4 E2M1 values per group along the input
  dim, two per byte, the low nibble first) and ``<name>_scales`` (uint8 ``[..., rows, G]``, E8M0
  exponents, bias 127: ``2 ** (s - 127)``; 255 is NaN and refused). Served as ``[..., rows,
  G * 32]`` (rows = the output dim), the layout before transformers' transpose into
  ``GptOssExperts``' ``[E, in, out]``.

Dequantization runs in float32 (exact for both formats), then the result is cast to the compute
dtype: kiln computes in that dtype, with no FP8/FP4 GEMM yet. Every refusal is a
:class:`~kiln.workloads.weights.WeightError` naming the tensor (or the config key).
"""

from __future__ import annotations

import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.weight_errors import WeightError

FP8 = "fp8"
MXFP4 = "mxfp4"
FP8_FORMATS = ("e4m3", "float8_e4m3fn")
SCALE_INV = "_scale_inv"
BLOCKS, SCALES = "_blocks", "_scales"
MX_GROUP = 32
"""FP4 values per MXFP4 scale (16 bytes)."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 value of each nibble (bit 3 the sign, then 2 exponent bits and 1 mantissa bit)."""
_FLOAT8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def _weight_error(message: str) -> Exception:
    return WeightError(message)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's storage format: ``method`` None (plain), ``"fp8"`` or ``"mxfp4"``; the FP8
    block; the ``modules_to_not_convert`` patterns."""

    method: str | None = None
    block: tuple[int, int] = (128, 128)
    keep: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the load log and the store's notes."""
        if self.method == FP8:
            bm, bn = self.block
            return f"block-FP8 (e4m3, {bm}x{bn} blocks)"
        return "MXFP4 (E2M1, 32-value E8M0 groups)" if self.method == MXFP4 else "unquantized"

    def kept(self, name: str) -> bool:
        """Whether ``name`` (a tensor) is in ``modules_to_not_convert`` (transformers' rule: a
        pattern matching from the start up to a module boundary, as a regex, or as a suffix)."""
        module = name.rsplit(".", 1)[0]
        for key in self.keep:
            try:
                pattern = re.compile(rf"(?:{key})(?:(?<=\.)|(?=\.|$))")
            except re.error:  # not a regex: the name itself
                pattern = re.compile(rf"(?:{re.escape(key)})(?:(?<=\.)|(?=\.|$))")
            if any(pattern.match(full) or full.endswith(key) for full in (module, name)):
                return True
        return False


def quantization(config: ModelConfig) -> Quantization:
    """The storage format ``config``'s ``quantization_config`` declares; WeightError for an
    unknown ``quant_method``, an FP8 ``fmt`` other than e4m3, a ``weight_block_size`` that is
    not two positive integers, or a static activation scheme."""
    q = config.raw.get("quantization_config")
    if q is None:
        return Quantization()
    where = f"{config.name}: quantization_config"
    if not isinstance(q, dict):
        raise _weight_error(f"{where} is not an object")
    method = q.get("quant_method")
    keep = q.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise _weight_error(f"{where}.modules_to_not_convert is not a list of names")
    if method == MXFP4:
        return Quantization(MXFP4, keep=tuple(keep))
    if method != FP8:
        raise _weight_error(
            f"{where}.quant_method {method!r} is not read (kiln reads {FP8!r} and {MXFP4!r})"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise _weight_error(f"{where}.fmt {fmt!r} is not read (kiln reads e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise _weight_error(
            f"{where}.activation_scheme {q.get('activation_scheme')!r} (kiln reads 'dynamic')"
        )
    block = q.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise _weight_error(f"{where}.weight_block_size {block!r} is not two positive integers")
    return Quantization(FP8, (block[0], block[1]), tuple(keep))


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 ``weight [..., out, in] * scale_inv [..., ceil(out/bm), ceil(in/bn)]`` per block
    (shapes checked by the caller)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., rows, G * 32]`` of ``blocks [..., rows, G, 16]`` (uint8) and ``scales
    [..., rows, G]`` (uint8 E8M0); shapes checked by the caller."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2)


class CheckpointReader:
    """Tensors of a safetensors directory by name, dequantized per :class:`Quantization`; a
    context manager holding the files open."""

    def __init__(self, where: dict[str, Path], quant: Quantization, device: torch.device) -> None:
        self.where = where
        self.quant = quant
        self.device = device
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._names = set(where)
        if quant.method == MXFP4:  # <name>_blocks serves <name>
            self._names |= {n[: -len(BLOCKS)] for n in where if n.endswith(BLOCKS)}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def file(self, name: str) -> str:
        """The file holding ``name`` (its blocks, for an MXFP4 weight)."""
        path = self.where.get(name) or self.where.get(name + BLOCKS)
        return path.name if path is not None else "?"

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.where[name]
        if path not in self._handles:
            opened = safe_open(str(path), framework="pt", device=str(self.device))
            self._handles[path] = self._stack.enter_context(opened)
        return self._handles[path]

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _stored_dtype(self, name: str) -> str:
        return str(self._handle(name).get_slice(name).get_dtype())

    def _mx(self, name: str) -> bool:
        return self.quant.method == MXFP4 and name not in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape ``name`` is served in (an MXFP4 weight's: ``[..., rows, G * 32]``)."""
        if self._mx(name):
            *lead, groups, width = self._stored_shape(name + BLOCKS)
            return (*lead, groups * width * 2)
        return self._stored_shape(name)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``name`` in ``dtype`` (dequantized when the checkpoint quantizes it); WeightError for a
        missing or mis-shaped scale, a stored dtype the format does not define, or a quantized
        tensor listed in ``modules_to_not_convert``."""
        if self._mx(name):
            return self._read_mxfp4(name).to(dtype)
        tensor = self._handle(name).get_tensor(name)
        if tensor.dtype not in _FLOAT8:
            return tensor.to(dtype)
        here = f"{self.file(name)}: {name}"
        if self.quant.method != FP8:
            raise _weight_error(
                f"{here} is stored as {tensor.dtype} but config.json declares no FP8 "
                "quantization_config (its scales would be ignored)"
            )
        if tensor.dtype != torch.float8_e4m3fn:
            raise _weight_error(f"{here} is stored as {tensor.dtype}; fmt e4m3 needs float8_e4m3fn")
        if self.quant.kept(name):
            raise _weight_error(f"{here} is stored as FP8 but is in modules_to_not_convert")
        return self._read_fp8(name, tensor).to(dtype)

    def _read_fp8(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        scale_name = name + SCALE_INV
        if scale_name not in self.where:
            raise _weight_error(
                f"{self.file(name)}: {name} is FP8 but its scale {scale_name} is missing"
            )
        if weight.dim() < 2:
            raise _weight_error(f"{self.file(name)}: {name} is FP8 but not a matrix")
        scale = self._handle(scale_name).get_tensor(scale_name)
        bm, bn = self.quant.block
        rows, cols = weight.shape[-2:]
        want = (*weight.shape[:-2], math.ceil(rows / bm), math.ceil(cols / bn))
        if tuple(scale.shape) != want or not scale.dtype.is_floating_point:
            raise _weight_error(
                f"{self.file(scale_name)}: {scale_name} has shape {list(scale.shape)} "
                f"({scale.dtype}); {name} {list(weight.shape)} in the config's {bm}x{bn} blocks "
                f"needs a float scale of shape {list(want)}"
            )
        return dequantize_fp8(weight, scale, (bm, bn))

    def _read_mxfp4(self, name: str) -> torch.Tensor:
        blocks_name, scales_name = name + BLOCKS, name + SCALES
        where = self.file(name)
        if self.quant.kept(name):
            raise _weight_error(f"{where}: {blocks_name} is MXFP4 but is in modules_to_not_convert")
        if scales_name not in self.where:
            raise _weight_error(f"{where}: {blocks_name} has no scales ({scales_name} is missing)")
        blocks = self._handle(blocks_name).get_tensor(blocks_name)
        scales = self._handle(scales_name).get_tensor(scales_name)
        if blocks.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != MX_GROUP // 2:
            raise _weight_error(
                f"{where}: {blocks_name} is {blocks.dtype} {list(blocks.shape)}; MXFP4 blocks are "
                f"uint8 [..., rows, groups, {MX_GROUP // 2}]"
            )
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise _weight_error(
                f"{self.file(scales_name)}: {scales_name} is {scales.dtype} "
                f"{list(scales.shape)}; {blocks_name} {list(blocks.shape)} needs uint8 "
                f"{list(blocks.shape[:-1])}"
            )
        if bool((scales == 255).any()):
            raise _weight_error(f"{self.file(scales_name)}: {scales_name} holds E8M0 NaN (255)")
        return dequantize_mxfp4(blocks, scales)
