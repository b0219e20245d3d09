"""gpt-oss (``model_type: gpt_oss``, transformers' ``GptOssForCausalLM``): what of its
``config.json`` kiln reads beyond a Llama-style decoder, and which op params its sites add.

- ``layer_types``: ``"sliding_attention"`` layers attend to the last ``sliding_window`` tokens
  (a query at position ``p`` sees slots ``p - window < s <= p``, transformers'
  ``sliding_window_overlay``), ``"full_attention"`` layers to all. Missing: even layers slide,
  odd layers are full (``GptOssConfig``'s default).
- Every attention layer has learned per-head sinks, q/k/v/o biases (``attention_bias``) and YaRN
  RoPE (its cos/sin factor ``f`` is folded into the softmax scale as ``f**2``).
- KV cache (first version): every layer, sliding ones too, holds the whole context
  (:class:`~kiln.workloads.models.kv_cache.StaticKVCache`, and ``kv_bytes_per_token`` counts
  every layer as full); a sliding layer reads only its window of it.
- MoE on every layer: a router with a bias, top-k of the logits then softmax over those k;
  experts with biases and the clamped SwiGLU (:mod:`kiln.ops.moe_clamped`).

Importing does not import torch. :data:`SITE_PARAMS` names the params gpt-oss sites pass beyond
every model's: an implementation whose signature lacks one of them is refused for gpt-oss (by
binding's signature check and by :mod:`kiln.runtime.support`), never run without it.
"""

from __future__ import annotations

from typing import Any

from kiln.workloads.config_bounds import ConfigRangeError, UnsupportedModelError, real, whole

GPT_OSS = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
SWIGLU_ALPHA_DEFAULT = 1.702
SWIGLU_LIMIT_DEFAULT = 7.0

SITE_PARAMS: dict[str, tuple[str, ...]] = {
    "attention": ("sinks", "window"),
    "moe": ("swiglu",),
}
"""Op -> params a gpt-oss site adds (attention sinks and window, the experts' clamped SwiGLU with
biases); an implementation must accept all of them to run gpt-oss."""


def sliding_layers(cfg: dict[str, Any], name: str, layers: int) -> tuple[int, ...]:
    """The sliding-window layers of a gpt-oss ``cfg`` (module docstring).

    Raises:
        UnsupportedModelError: ``layer_types`` not a list of the two known kinds.
        ConfigRangeError: ``layer_types`` not one entry per layer.
    """
    kinds = cfg.get("layer_types")
    if kinds is None:
        return tuple(range(0, layers, 2))
    if not isinstance(kinds, list) or any(k not in (SLIDING, FULL) for k in kinds):
        raise UnsupportedModelError(
            f"{name}: layer_types must list {SLIDING!r} or {FULL!r} per layer"
        )
    if len(kinds) != layers:
        raise ConfigRangeError(f"{name}: layer_types has {len(kinds)} entries for {layers} layers")
    return tuple(i for i, k in enumerate(kinds) if k == SLIDING)


def sliding_window(cfg: dict[str, Any], name: str) -> int | None:
    """``sliding_window`` (tokens, within ``max_position_embeddings``'s range) or None."""
    if cfg.get("sliding_window") is None:
        return None
    return whole({"max_position_embeddings": cfg["sliding_window"]}, "max_position_embeddings",
                 f"{name} (sliding_window)")  # fmt: skip


def swiglu_constants(cfg: dict[str, Any], name: str) -> tuple[float, float]:
    """``(swiglu_alpha, swiglu_limit)`` of a gpt-oss ``cfg`` (defaults 1.702, 7.0)."""
    alpha = real(cfg, "swiglu_alpha", name, SWIGLU_ALPHA_DEFAULT, low=0.0, high=1e3)
    limit = real(cfg, "swiglu_limit", name, SWIGLU_LIMIT_DEFAULT, low=0.0, high=1e6)
    return alpha, limit


def refusal(raw: dict[str, Any]) -> str | None:
    """What of a gpt-oss config kiln does not build (None: nothing)."""
    if raw.get("hidden_act", "silu") != "silu":
        return f"gpt_oss with hidden_act {raw.get('hidden_act')!r} (its experts use SwiGLU)"
    if raw.get("attention_bias") is False:
        return "gpt_oss without attention biases (its checkpoints have them)"
    return None


def quantization_note(raw: dict[str, Any]) -> str | None:
    """A note when the config carries ``quantization_config`` and the weights are random: kiln
    builds gpt-oss in the config's dtype (a checkpoint's MXFP4 experts are dequantized into it
    at load: :func:`kiln.workloads.gpt_oss_weights.load_gpt_oss`)."""
    q = raw.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method", "?")
    return (
        f"quantization_config {method!r} is not applied: kiln builds the experts in the model "
        "dtype (random weights; a checkpoint's MXFP4 experts are dequantized into it at load)"
    )
