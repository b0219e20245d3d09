"""RoPE inverse frequencies of a model config: ``default`` and ``llama3`` scaling.

:func:`inv_freq` gives the ``inv_freq [D/2]`` float32 base parameter of the ``rope`` ops
(:mod:`kiln.ops.rope`); :func:`rope_parameters` the config's RoPE settings as one dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
