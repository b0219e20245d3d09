"""RoPE inverse frequencies of a model config: ``default``, ``llama3`` and ``yarn`` scaling.

:func:`inv_freq` gives the ``inv_freq [D/2]`` float32 base parameter of the ``rope`` ops
(:mod:`kiln.ops.rope`), D = :func:`rotary_dim`; :func:`rope_parameters` the config's RoPE
settings as one dict; :func:`attention_factor` YaRN's scale of cos/sin and
:func:`mla_softmax_scale` DeepSeek's softmax scale (transformers' ``modeling_rope_utils`` and
``models/deepseek_v3``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.workloads.config import ModelConfig

Tensor = torch.Tensor

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


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


def rotary_dim(config: ModelConfig) -> int:
    """The rotated width D: ``qk_rope_head_dim`` for MLA (its decoupled rope dims); for
    MiniMax-M2 its ``rotary_dim`` (else ``head_dim * partial_rotary_factor``, as transformers'
    ``MiniMaxM2Config``), the leading D of each head's ``head_dim``; else ``head_dim``."""
    if config.mla is not None:
        return config.mla.qk_rope_head_dim
    if config.model_type == "minimax_m2":
        if config.raw.get("rotary_dim") is not None:
            return int(config.raw["rotary_dim"])
        factor = float(rope_parameters(config).get("partial_rotary_factor") or 1.0)
        return int(config.head_dim * factor)
    return config.head_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(config: ModelConfig, p: dict[str, Any]) -> float:
    factor = p.get("factor")
    if factor is None:
        return config.max_position_embeddings / _original_len(config, p)
    return float(factor)


def _original_len(config: ModelConfig, p: dict[str, Any]) -> float:
    """YaRN's pre-training context (transformers' default: ``max_position_embeddings``)."""
    return float(p.get("original_max_position_embeddings") or config.max_position_embeddings)


def attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by: 1 except for ``yarn``, where it is
    ``attention_factor`` if set, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
    when both are set, else ``mscale(factor)`` (``_compute_yarn_parameters``); 1.0 for
    DeepSeek-V3 (``mscale == mscale_all_dim``).
    """
    p = rope_parameters(config)
    if p["rope_type"] != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = _yarn_factor(config, p)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def mla_softmax_scale(config: ModelConfig) -> float:
    """DeepSeek-V3's attention scale: ``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` when the RoPE type is not ``default`` and ``mscale_all_dim`` is set
    (transformers' ``yarn_apply_mscale``). ValueError for a config without MLA.
    """
    if config.mla is None:
        raise ValueError(f"{config.name} has no latent attention")
    scale = float(config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim) ** -0.5
    p = rope_parameters(config)
    all_dim = p.get("mscale_all_dim")
    if p["rope_type"] != "default" and all_dim:
        mscale = _yarn_mscale(_yarn_factor(config, p), float(all_dim))
        scale = scale * mscale * mscale
    return scale


def _yarn(config: ModelConfig, p: dict[str, Any], dim: int, freq: Tensor) -> Tensor:
    """YaRN (Peng et al. 2023): the interpolated ``freq / factor`` blended into ``freq`` by a
    linear ramp between the correction dims of ``beta_fast`` and ``beta_slow`` rotations over
    ``original_max_position_embeddings`` (floor/ceil unless ``truncate`` is False)."""
    base = float(p["rope_theta"])
    factor = _yarn_factor(config, p)
    old_len = _original_len(config, p)
    fast, slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    steps = torch.arange(dim // 2, dtype=torch.float32, device=freq.device)
    ramp = ((steps - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled (extrapolated) frequency
    return (freq / factor) * (1 - keep) + freq * keep


def inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> Tensor:
    """Inverse frequencies ``[D/2]`` float32 for the config's RoPE type, D = :func:`rotary_dim`.

    ``default``: ``1 / theta ** (2i / D)``. ``llama3``: the default frequencies with long
    wavelengths divided by ``factor`` and a smooth blend between ``low_freq_factor`` and
    ``high_freq_factor`` (transformers' ``_compute_llama3_parameters``, Llama 3.1 release).
    ``yarn``: :func:`_yarn` (transformers' ``_compute_yarn_parameters``); its cos/sin factor is
    :func:`attention_factor`, applied by the caller.

    Raises:
        UnsupportedRopeError: a RoPE type other than those of :data:`SUPPORTED_ROPE_TYPES`,
            ``yarn`` without MLA (or gpt-oss), or a partial rotary factor (except MiniMax-M2's).
    """
    p = rope_parameters(config)
    kind = p["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"{config.name}: RoPE type {kind!r} is not implemented "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind == "yarn" and config.mla is None and config.model_type != "gpt_oss":
        raise UnsupportedRopeError(
            f"{config.name}: RoPE type 'yarn' is implemented for latent attention (MLA) and "
            "gpt-oss only (its cos/sin factor is applied by mla_proj, or gpt-oss's attention scale)"
        )
    partial = config.model_type == "minimax_m2"  # its rotary_dim, a leading share of head_dim
    if not partial and float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedRopeError(f"{config.name}: partial rotary embeddings are not implemented")
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    freq = 1.0 / (float(p["rope_theta"]) ** (exponents / dim))
    if kind == "default":
        return freq
    if kind == "yarn":
        return _yarn(config, p, dim, freq)
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
