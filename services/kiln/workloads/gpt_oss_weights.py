"""Weight names and shapes of gpt-oss, seeded random weights for it, and the conversion to
transformers' ``GptOssForCausalLM`` state dict.

Names are transformers' (5.x); the store holds the experts in kiln's ``moe`` layout under them:
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.gate_up_proj_bias [E, 2I]`` with the
gate rows first, ``mlp.experts.down_proj [E, H, I]``, ``mlp.experts.down_proj_bias [E, H]``.
transformers holds ``gate_up_proj [E, H, 2I]`` with gate and up *interleaved* (gate in the even
columns, ``GptOssExperts._apply_gate``) and ``down_proj [E, I, H]``;
:func:`to_transformers` converts. Other names: ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks [Hq]``, ``mlp.router.weight [E, H]``, ``mlp.router.bias [E]``.

Published checkpoints (:func:`load_gpt_oss`) hold the experts as MXFP4 ``*_blocks`` /
``*_scales`` (:mod:`kiln.workloads.quantized_checkpoint`): dequantized, ``gate_up_proj`` is
``[E, 2I, H]`` with gate and up rows interleaved (its bias ``[E, 2I]`` too), ``down_proj``
``[E, H, I]``; the loader puts the gate rows first.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.gpt_oss import quantization_note
from kiln.workloads.quantized_checkpoint import MXFP4, quantization
from kiln.workloads.weights import (
    EMBED,
    LM_HEAD,
    WeightError,
    WeightStore,
    _index,
    load_safetensors,
    seeded_tensors,
)

Tensor = torch.Tensor
GATE_UP = "mlp.experts.gate_up_proj"
GATE_UP_BIAS = "mlp.experts.gate_up_proj_bias"
DOWN = "mlp.experts.down_proj"
DOWN_BIAS = "mlp.experts.down_proj_bias"


def gpt_oss_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and (kiln-layout) shapes of a gpt-oss model with ``config``'s layers; WeightError
    for another model type or one without MoE."""
    if config.model_type != "gpt_oss" or config.moe is None:
        raise WeightError(f"{config.name}: not a gpt-oss model")
    h, v, d = config.hidden_size, config.vocab_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    e, inter = config.moe.num_experts, config.moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
            shapes[f"{a}{proj}_proj.weight"] = (rows, h)
            shapes[f"{a}{proj}_proj.bias"] = (rows,)
        shapes[a + "o_proj.weight"] = (h, hq * d)
        shapes[a + "o_proj.bias"] = (h,)
        shapes[a + "sinks"] = (hq,)
        shapes[p + "mlp.router.weight"] = (e, h)
        shapes[p + "mlp.router.bias"] = (e,)
        shapes[p + GATE_UP] = (e, 2 * inter, h)
        shapes[p + GATE_UP_BIAS] = (e, 2 * inter)
        shapes[p + DOWN] = (e, h, inter)
        shapes[p + DOWN_BIAS] = (e, h)
    return shapes


def seeded_random_gpt_oss(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """Random weights of :func:`gpt_oss_shapes` in ``dtype``: norms 1, everything else (biases
    and sinks too) ``normal(0, initializer_range)`` drawn in float32 from a generator on
    ``device`` seeded by ``(seed, name)``, stacked experts one expert at a time. A fast tier's
    layers equal the full model's. A ``quantization_config`` is not applied (the store's
    ``notes`` say so). WeightError for another model type.
    """
    tensors = seeded_tensors(gpt_oss_shapes(config), config, dtype, device, seed)
    note = quantization_note(config.raw)
    return WeightStore(tensors, tied=config.tie_word_embeddings, notes=(note,) if note else ())


def _interleave(gate_first: Tensor) -> Tensor:
    """``[..., 2I]`` gate-first -> gate in the even, up in the odd positions."""
    gate, up = gate_first.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _deinterleave(rows: Tensor, dim: int) -> Tensor:
    """Gate in the even, up in the odd positions of ``dim`` -> gate first."""
    index = torch.arange(rows.shape[dim], device=rows.device)
    order = torch.cat((index[0::2], index[1::2]))
    return rows.index_select(dim, order).contiguous()


def load_gpt_oss(
    directory: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> WeightStore:
    """A published gpt-oss checkpoint (``quant_method: mxfp4``, experts as ``*_blocks`` /
    ``*_scales``) dequantized into ``dtype`` and held in kiln's layout (module docstring).
    WeightError: another quantization, experts stored unquantized (their layout would be
    ambiguous), or what :func:`~kiln.workloads.weights.load_safetensors` refuses.
    """
    if quantization(config).method != MXFP4:
        raise WeightError(
            f"{config.name}: gpt-oss checkpoints are read as published, with quantization_config "
            f"quant_method {MXFP4!r}"
        )
    root = Path(directory)
    if root.is_dir():
        stored = _index(root)
        plain = [n for n in stored if n.endswith((GATE_UP, DOWN))]
        if plain:
            raise WeightError(
                f"{root}: {plain[0]} is stored unquantized; kiln reads gpt-oss experts as "
                "published (MXFP4 *_blocks and *_scales)"
            )
    store = load_safetensors(root, config, dtype, device, shapes=gpt_oss_shapes(config))
    tensors = dict(store.items())
    for name in gpt_oss_shapes(config):
        if name.endswith((GATE_UP, GATE_UP_BIAS)):  # [E, 2I, H] / [E, 2I]: rows interleaved
            tensors[name] = _deinterleave(tensors[name], 1)
    return WeightStore(tensors, notes=store.notes)  # a tied head is held under both names


def to_transformers(store: WeightStore, config: ModelConfig) -> dict[str, Tensor]:
    """The state dict of transformers' ``GptOssForCausalLM`` holding ``store``'s weights (new
    tensors for the experts, the store's own for the rest)."""
    out: dict[str, Tensor] = {}
    for name in gpt_oss_shapes(config):
        t = store[name]
        if name.endswith(GATE_UP):
            t = _interleave(t.transpose(1, 2)).contiguous()  # [E, H, 2I]
        elif name.endswith(GATE_UP_BIAS):
            t = _interleave(t).contiguous()
        elif name.endswith(DOWN):
            t = t.transpose(1, 2).contiguous()  # [E, I, H]
        out[name] = t
    return out
