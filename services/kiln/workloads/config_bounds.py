"""Ranges of a model ``config.json``'s fields, and readers that enforce them.

Every number :func:`kiln.workloads.config.parse_config` reads goes through :func:`whole` or
:func:`real`, so a config reaching a service (the cost model's Plan, the Compiler API's Submit) is
refused before any loop runs over its layers or experts. The limits are generous but finite: each
is well above the largest published model the comment names, and small enough that the planner's
and the roofline's per-layer work stays in milliseconds.

Errors: :class:`ConfigRangeError` for a number outside its range (services answer OUT_OF_RANGE),
:class:`kiln.workloads.config.UnsupportedModelError` (its base) for a value of the wrong kind.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.domain.quoting import quote


class UnsupportedModelError(ValueError):
    """The config names an architecture kiln cannot build, or is not a valid config."""


class ConfigRangeError(UnsupportedModelError):
    """A config number outside the range :data:`LIMITS` gives it (message: field, value,
    range)."""


LIMITS: dict[str, tuple[int, int]] = {
    # Llama-3.1-405B has 126 layers, DeepSeek-V3 61: 4,096 leaves 32x headroom.
    "num_hidden_layers": (1, 4096),
    # Llama-3.1-405B: hidden 16,384, FFN 53,248; 8x and ~20x headroom.
    "hidden_size": (1, 131_072),
    "intermediate_size": (1, 1_048_576),
    "moe_intermediate_size": (1, 1_048_576),
    # 128 query heads (Llama-3.1-405B, DeepSeek-V3); head_dim 256 at most (Gemma).
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    # Gemma 3: 262,144 tokens; 16x headroom.
    "vocab_size": (1, 4_194_304),
    # Llama 4 Scout: 10M tokens of context; 2^24 = 16,777,216.
    "max_position_embeddings": (1, 1 << 24),
    # DeepSeek-V3: 256 routed experts, 8 per token, 1 shared; Kimi K2 384 routed.
    "num_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "n_shared_experts": (0, 64),
    # Layer indices and counts are bounded by num_hidden_layers (checked by the parser).
    "decoder_sparse_step": (1, 4096),
    "first_k_dense_replace": (0, 4096),
    # DeepSeek-V3: 8 expert groups, 4 picked per token.
    "n_group": (1, 4096),
    "topk_group": (1, 4096),
    # DeepSeek-V3 MLA: q_lora_rank 1,536, kv_lora_rank 512, head dims 128 / 64.
    "q_lora_rank": (1, 65_536),
    "kv_lora_rank": (1, 65_536),
    "qk_nope_head_dim": (1, 4096),
    "qk_rope_head_dim": (1, 4096),
    "v_head_dim": (1, 4096),
    # GLM-5's sparse-attention indexer: 32 heads of 128, top 2,048 keys per query.
    "index_n_heads": (1, 4096),
    "index_head_dim": (1, 4096),
    "index_topk": (1, 1 << 24),
}
"""(lowest, highest) accepted value of each integer field, inclusive."""

MAX_ROPE_THETA = 1e12
"""Largest RoPE base (Llama 3: 500,000; long-context models up to ~1e8)."""
MAX_ROUTED_SCALING = 1e3
"""Largest ``routed_scaling_factor`` (DeepSeek-V3: 2.5, Kimi-K2: 2.827)."""
MAX_CONFIG_CHARS = 1 << 20
"""Longest ``config_json`` text: real configs are 1-10 KB; 1 MiB is generous."""
MAX_NAME_CHARS = 256
"""Longest model name (a Hugging Face repository id is at most 96 characters)."""
MAX_DTYPE_CHARS = 32
"""Longest ``torch_dtype`` text ("float8_e4m3fn" is 13)."""

_MISSING = object()


def whole(
    cfg: dict[str, Any], key: str, name: str, default: Any = _MISSING, *, high: int | None = None
) -> int:
    """``cfg[key]`` as an int within ``LIMITS[key]`` (``high`` lowers the top, e.g. to the layer
    count); ``default`` when missing or null (an error when no default is given).

    Raises:
        UnsupportedModelError: missing without a default; not a whole number (bools, text,
            fractions, NaN and infinities such as ``1e400`` included).
        ConfigRangeError: outside the range.
    """
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise UnsupportedModelError(f"{name}: config has no {key!r}")
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(f"{name}: {key} must be a whole number, got {quote(value)}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise UnsupportedModelError(f"{name}: {key} must be a whole number, got {quote(value)}")
        value = int(value)
    low, top = LIMITS[key]
    if high is not None:
        top = min(top, high)
    if not low <= value <= top:
        raise ConfigRangeError(f"{name}: {key} = {value} is out of range {low}..{top}")
    return value


def real(
    cfg: dict[str, Any], key: str, name: str, default: float, *, low: float, high: float
) -> float:
    """``cfg[key]`` as a finite float with ``low < value <= high`` (``default`` when missing).

    Raises:
        UnsupportedModelError: not a number, NaN or infinite.
        ConfigRangeError: outside the range.
    """
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(f"{name}: {key} must be a number, got {quote(value)}")
    if not math.isfinite(value):
        raise UnsupportedModelError(f"{name}: {key} must be finite, got {value!r}")
    if not low < value <= high:
        raise ConfigRangeError(f"{name}: {key} = {value!r} is out of range ({low:g}, {high:g}]")
    return float(value)


def layer_list(cfg: dict[str, Any], key: str, name: str, layers: int) -> set[int]:
    """``cfg[key]`` (a list of layer indices, or missing/null) as a set, each in
    ``0..layers-1`` and at most ``layers`` entries.

    Raises:
        UnsupportedModelError: not a list, or an entry not a whole number.
        ConfigRangeError: too many entries, or an index out of range.
    """
    value = cfg.get(key)
    if value is None:
        return set()
    if not isinstance(value, list):
        raise UnsupportedModelError(f"{name}: {key} must be a list of layer indices")
    if len(value) > layers:
        raise ConfigRangeError(f"{name}: {key} lists {len(value)} layers; the model has {layers}")
    out = set()
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise UnsupportedModelError(
                f"{name}: {key} entries must be integers, got {quote(item)}"
            )
        if not 0 <= item < layers:
            raise ConfigRangeError(f"{name}: {key} entry {item} is out of range 0..{layers - 1}")
        out.add(item)
    return out


def finite_tree(value: Any, name: str, key: str) -> None:
    """Refuse a non-finite number anywhere in ``value`` (a small JSON sub-tree such as
    ``rope_scaling``): UnsupportedModelError."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise UnsupportedModelError(f"{name}: {key} holds a non-finite number ({item!r})")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
