"""Weight names and shapes of GLM-5 (``glm_moe_dsa``), seeded random weights for it, and reading
its checkpoints.

Names and shapes are transformers' ``GlmMoeDsaForCausalLM`` state dict: DeepSeek-V3's
(:func:`kiln.workloads.mla_weights.mla_shapes`) plus per layer the indexer's
``self_attn.indexer.wq_b.weight [Hi*Di, Rq]``, ``wk.weight [Di, H]``, ``k_norm.weight [Di]``,
``k_norm.bias [Di]`` and ``weights_proj.weight [Hi, H]``. Random weights follow
:func:`kiln.workloads.weights.seeded_tensors` (norms 1, correction biases and the key norm's bias
float32 zeros, the rest normal), except ``weights_proj``, drawn and kept in float32 as
transformers keeps it (``_keep_in_fp32_modules``). Checkpoints as published (transformers'
``save_pretrained`` names: DeepSeek-V3's per-expert ``mlp.experts.{e}.*_proj``, the indexer's as
above; block-FP8 dequantized at load) are read by :func:`load_glm`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.mla_weights import CORRECTION_BIAS, mla_shapes
from kiln.workloads.weights import WeightError, WeightStore, load_safetensors, seeded_tensors

INDEXER = "self_attn.indexer"
"""The indexer's module path within a layer (``model.layers.{i}.``)."""
HEAD_WEIGHTS = "weights_proj.weight"
KEY_NORM_BIAS = "k_norm.bias"


def indexer_prefix(layer: int) -> str:
    """HF prefix of layer ``layer``'s indexer (no trailing dot)."""
    return f"model.layers.{layer}.{INDEXER}"


def glm_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a GLM-5 model with ``config``'s layers; WeightError without the
    indexer (or MLA)."""
    dsa, mla = config.dsa, config.mla
    if dsa is None or mla is None or not mla.q_lora_rank:
        raise WeightError(f"{config.name}: not a sparse-attention (glm_moe_dsa) model")
    shapes = mla_shapes(config)
    h, heads, d = config.hidden_size, dsa.n_heads, dsa.head_dim
    for i in range(config.num_hidden_layers):
        p = indexer_prefix(i) + "."
        shapes[p + "wq_b.weight"] = (heads * d, mla.q_lora_rank)
        shapes[p + "wk.weight"] = (d, h)
        shapes[p + "k_norm.weight"] = (d,)
        shapes[p + KEY_NORM_BIAS] = (d,)
        shapes[p + HEAD_WEIGHTS] = (heads, h)
    return shapes


def seeded_random_glm(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """Random weights of :func:`glm_shapes` (module docstring): same seed, same weights on the
    same device type; a fast tier's layers equal the full model's. The key norm's bias is
    float32 zeros, cast to ``dtype``."""
    shapes = glm_shapes(config)
    head = {n: s for n, s in shapes.items() if n.endswith(HEAD_WEIGHTS)}
    rest = {n: s for n, s in shapes.items() if n not in head}
    zeros = (CORRECTION_BIAS, KEY_NORM_BIAS)
    tensors = seeded_tensors(rest, config, dtype, device, seed, zeros=zeros)
    for name, t in tensors.items():
        if name.endswith(KEY_NORM_BIAS):
            tensors[name] = t.to(dtype)
    tensors.update(seeded_tensors(head, config, torch.float32, device, seed))
    ordered = {n: tensors[n] for n in shapes}
    return WeightStore(ordered, tied=config.tie_word_embeddings)


def load_glm(
    directory: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> WeightStore:
    """``directory``'s weights of :func:`glm_shapes`, read by
    :func:`kiln.workloads.weights.load_safetensors` (per-expert tensors stacked, block-FP8
    dequantized into ``dtype``, other tensors in the files such as the MTP layer ignored) and
    held as the random weights are: correction biases and ``weights_proj`` float32, the rest
    ``dtype``. WeightError naming a missing or mis-shaped tensor (the indexer's included), or
    what the loader refuses."""
    shapes = glm_shapes(config)
    keep = (CORRECTION_BIAS, HEAD_WEIGHTS)
    return load_safetensors(directory, config, dtype, device, shapes=shapes, float32=keep)
