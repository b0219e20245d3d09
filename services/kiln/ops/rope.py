"""``rope``: rotary position embedding of queries and keys (Su et al. 2021, RoFormer).

Call: ``rope(q, k, positions) -> (q, k)``. Base params: ``inv_freq [D/2]`` float32 (from
:func:`inv_freq`) and ``max_positions`` (the engine's KV-cache length; positions are below it).
The rotation pairs dimension ``i`` with ``i + D/2`` ("rotate half"), as transformers'
``apply_rotary_pos_emb`` does for Llama and Qwen3 checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from kiln.ops.registry import Derivation, register
from kiln.workloads.config import ModelConfig

Tensor = torch.Tensor

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedRopeError(ValueError):
    """The config asks for a RoPE scaling kiln does not implement (message lists the known)."""


def rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    Reads ``rope_scaling`` (``rope_type``, or the older ``type``) and ``rope_theta``, or a
    transformers-5 style ``rope_parameters`` entry of the raw config when present.
    """
    raw = config.raw.get("rope_parameters")
    if isinstance(raw, dict) and "rope_theta" in raw:
        params = dict(raw)
    else:
        params = dict(config.rope_scaling or {})
        params["rope_theta"] = config.rope_theta
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> Tensor:
    """Inverse frequencies ``[D/2]`` float32 for the config's RoPE type.

    ``default``: ``1 / theta ** (2i / D)``. ``llama3``: the default frequencies with long
    wavelengths divided by ``factor`` and a smooth blend between ``low_freq_factor`` and
    ``high_freq_factor`` (transformers' ``_compute_llama3_parameters``, Llama 3.1 release).

    Raises:
        UnsupportedRopeError: a RoPE type other than ``default`` or ``llama3``, or a partial
            rotary factor.
    """
    p = rope_parameters(config)
    kind = p["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"{config.name}: RoPE type {kind!r} is not implemented "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedRopeError(f"{config.name}: partial rotary embeddings are not implemented")
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    freq = 1.0 / (float(p["rope_theta"]) ** (exponents / dim))
    if kind == "default":
        return freq
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * [cos, cos] + rotate_half(x) * [sin, sin]`` in float32, cast back to ``x.dtype``.
    ``cos``/``sin``: ``[B, 1, T, D/2]`` float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@register("rope", "reference")
def reference(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    *,
    inv_freq: Tensor,
    max_positions: int,
) -> tuple[Tensor, Tensor]:
    """Angles ``positions * inv_freq`` computed per call, rotation in float32.

    Args:
        q: ``[B, Hq, T, D]``; k: ``[B, Hkv, T, D]`` (model dtype, any strides).
        positions: ``[B, T]`` int64 token positions (``< max_positions``; unchecked here).
        inv_freq: ``[D/2]`` float32.
        max_positions: unused by this implementation (the bound for table-based ones).

    Returns:
        Rotated ``(q, k)``, same shapes and dtypes, contiguous.
    """
    del max_positions
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def cos_sin_table(params: Mapping[str, Any]) -> dict[str, Any]:
    """Precomputed ``cos``/``sin`` ``[max_positions, D/2]`` float32 of ``p * inv_freq``
    (vLLM's ``cos_sin_cache``)."""
    freq = params["inv_freq"]
    pos = torch.arange(params["max_positions"], device=freq.device, dtype=torch.float)
    angles = pos[:, None] * freq
    return {"cos": angles.cos(), "sin": angles.sin()}


COS_SIN_TABLE = Derivation("rope_cos_sin_table", cos_sin_table)


@register("rope", "cos_sin_cache", derived=COS_SIN_TABLE)
def cos_sin_cache(
    q: Tensor, k: Tensor, positions: Tensor, *, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`reference`, reading angles from the derived table
    (:func:`cos_sin_table`) instead of computing ``cos``/``sin`` per call. Positions must be
    ``< max_positions`` (an index error on CPU)."""
    c, s = cos[positions][:, None], sin[positions][:, None]
    return _rotate(q, c, s), _rotate(k, c, s)
