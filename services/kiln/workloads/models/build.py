"""Build a :class:`~kiln.workloads.models.decoder.DecoderModel` from a model config.

gpt-fast's ``Transformer.from_name`` for kiln: the config picks the architecture, the weights
come from a local safetensors directory or a seed, the cache is static.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kiln.domain.quoting import quote
from kiln.workloads.config import ModelConfig
from kiln.workloads.models import routing
from kiln.workloads.models.binding import OpBinding
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.models.rope_frequencies import SUPPORTED_ROPE_TYPES, rope_parameters
from kiln.workloads.weights import WeightStore, load_safetensors, seeded_random

BUILDABLE_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "mixtral")


class UnbuildableModelError(NotImplementedError):
    """kiln parses this config but cannot build it yet (MLA, shared experts, an unsupported
    feature); the message says which and why."""


def check_buildable(config: ModelConfig) -> None:
    """Raise :class:`UnbuildableModelError` unless ``config`` is a Llama / Qwen3 dense model or
    a Qwen3-MoE / Mixtral model (top-k routed SwiGLU experts, no shared experts) with default or
    Llama-3 RoPE, SiLU, no MLP bias and no sliding window. DeepSeek-V3 is refused for its MLA
    attention (and its shared experts and grouped routing)."""
    why = None
    raw = config.raw
    if config.mla is not None:
        why = f"{config.model_type!r}: MLA attention"
    elif config.moe is not None and config.moe.num_shared_experts:
        why = f"{config.model_type!r}: shared experts"
    elif config.model_type not in BUILDABLE_MODEL_TYPES:
        why = f"model type {config.model_type!r} (buildable: {', '.join(BUILDABLE_MODEL_TYPES)})"
    elif raw.get("mlp_bias"):
        why = "MLP biases"
    elif raw.get("use_sliding_window") or (
        config.model_type == "mixtral" and raw.get("sliding_window")
    ):
        why = "sliding-window attention"
    elif raw.get("hidden_act", "silu") != "silu":
        why = f"activation {quote(raw.get('hidden_act'))}"
    elif rope_parameters(config)["rope_type"] not in SUPPORTED_ROPE_TYPES:
        kind = rope_parameters(config)["rope_type"]
        why = f"RoPE type {quote(kind)} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    if why is not None:
        raise UnbuildableModelError(f"{config.name}: kiln cannot build {why}")


def build_model(
    config: ModelConfig,
    *,
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    weights_dir: str | Path | None = None,
    weights: WeightStore | None = None,
    max_batch: int = 1,
    max_seq_len: int = 2048,
    recipe: Mapping[str, str] | None = None,
    allow_lossy: bool = False,
) -> DecoderModel:
    """A model of ``config`` made of swappable ops.

    Args:
        config: the architecture.
        layers: keep only the first N layers (the fast tier; embedding and LM head kept).
        dtype, device: of weights, activations and cache.
        seed: for :func:`~kiln.workloads.weights.seeded_random` when no weights are given, and for
            the router biases fitted here to ``config.moe.load_zipf_exponent`` (measured load:
            ``model.expert_load``; :mod:`kiln.workloads.models.routing`). Checkpoint weights and a
            given store get no new bias.
        weights_dir: a local directory of ``*.safetensors`` with HF names (instead of random).
        weights: an existing store to share (instead of reading or drawing weights).
        max_batch, max_seq_len: KV-cache capacity (sequences, tokens per sequence).
        recipe: op → implementation name; other ops use ``reference``.
        allow_lossy: permit lossy implementations in ``recipe``.

    Raises:
        UnbuildableModelError: an architecture or feature kiln cannot build yet.
        ValueError: ``layers`` outside ``1..num_hidden_layers``.
        kiln.workloads.weights.WeightError: missing or mis-shaped weights.
        kiln.ops.registry.UnknownOpError, UnknownImplementationError: a bad recipe.
    """
    check_buildable(config)
    cfg = config.with_layers(layers) if layers is not None else config
    binding = OpBinding.from_recipe(recipe, allow_lossy=allow_lossy)
    skew = cfg.moe is not None and cfg.moe.load_zipf_exponent > 0
    calibrate = False
    if weights is None:
        if weights_dir is not None:
            weights = load_safetensors(weights_dir, cfg, dtype, device)
        else:
            weights = seeded_random(cfg, dtype, device, seed)
            if skew:
                routing.add_router_biases(weights, cfg)
                calibrate = True
    cache = StaticKVCache.for_config(
        cfg, max_batch=max_batch, max_len=max_seq_len, dtype=dtype, device=device
    )
    model = DecoderModel(cfg, weights, cache, binding)
    if calibrate:
        model.expert_load = routing.calibrate_router_bias(model, seed=seed)
    return model
