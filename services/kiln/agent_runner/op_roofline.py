"""The memory roofline of each op of one decode step: the bytes it must move, over bandwidth.

A decode step at batch B and context C is memory-bound for the batches kiln serves, so an op's
floor is the bytes it must read divided by the device's memory bandwidth. Counted per op (the
names of :mod:`kiln.ops.registry`), over the ``layers`` decoder layers the engine held:

- ``qkv_proj``: the q, k, v weights (and biases): ``H·(Hq·d + 2·Hkv·d)`` elements per layer;
- ``o_proj``: ``Hq·d·H`` per layer (+ bias);
- ``mlp``: gate, up and down: ``3·H·I`` per dense layer;
- ``moe``: the router ``E·H``, plus the experts a step touches: with B·k routed choices spread
  uniformly over E experts, ``E·(1 − (1 − k/E)^B)`` distinct experts are expected, each
  ``3·H·I_e`` (gate, up, down), plus ``3·H·I_e`` per shared expert;
- ``attention``: the KV cache read: ``2·B·(C+1)·Hkv·d`` per layer (K and V of the C cached
  tokens and the step's own);
- ``rms_norm``: the norm weights: 2·H per layer (input, post-attention; + 2·d for Qwen3's q/k
  norms) and H for the final norm;
- ``embedding``: the B rows gathered, ``B·H``; ``lm_head``: the whole ``V·H`` matrix (tied or
  not, a decode step reads all of it);
- ``rope``, ``sampler``: 0 (they read only activations and a small table).

Elements are multiplied by ``dtype_bytes`` (weights and KV cache in the engine's dtype).
Activations are left out (negligible next to the weights at decode: B·H per op). Sources: the
HF Llama/Qwen3/Mixtral module shapes (``kiln.workloads.models.slots``); the expected number of
distinct experts is the occupancy of B·k uniform draws over E bins.
"""

from __future__ import annotations

from kiln.cost_model.hardware import Hardware, get_hardware
from kiln.workloads.config import ModelConfig


def op_bytes(
    config: ModelConfig, *, layers: int, batch_size: int, context_len: int, dtype_bytes: int
) -> dict[str, int]:
    """Bytes each op must read in one decode step (see the module docs).

    Args:
        config: the model architecture (all layers; only the first ``layers`` count).
        layers: decoder layers held by the engine (1..``num_hidden_layers``).
        batch_size: sequences decoded together (B >= 1).
        context_len: tokens already in each sequence's KV cache (C >= 0).
        dtype_bytes: bytes per weight / KV element (2 for bf16, 4 for fp32).

    Returns:
        op name -> bytes per decode step (ops the model does not call are absent).

    Raises:
        ValueError: a bad count, or an MLA model (its latent KV cache is not modelled here).
    """
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"layers {layers} is outside 1..{config.num_hidden_layers}")
    if batch_size < 1 or context_len < 0 or dtype_bytes < 1:
        raise ValueError(
            f"need batch_size >= 1, context_len >= 0, dtype_bytes >= 1; got {batch_size}, "
            f"{context_len}, {dtype_bytes}"
        )
    if config.mla is not None:
        raise ValueError(f"{config.name}: MLA attention is not modelled by the op roofline")
    h, d = config.hidden_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    bias = config.attention_bias
    qkv = h * (hq + 2 * hkv) * d + ((hq + 2 * hkv) * d if bias else 0)
    o = hq * d * h + (h if bias else 0)
    norms = 2 * h + (2 * d if config.qk_norm else 0)
    kv = 2 * batch_size * (context_len + 1) * hkv * d
    elems: dict[str, int] = {
        "embedding": batch_size * h,
        "qkv_proj": layers * qkv,
        "rope": 0,
        "attention": layers * kv,
        "o_proj": layers * o,
        "rms_norm": layers * norms + h,
        "lm_head": config.vocab_size * h,
        "sampler": 0,
    }
    moe_layers = [i for i in range(layers) if config.moe is not None and config.is_moe_layer(i)]
    dense_layers = layers - len(moe_layers)
    if dense_layers:
        elems["mlp"] = dense_layers * 3 * h * config.intermediate_size
    if moe_layers and config.moe is not None:
        moe = config.moe
        e, k = moe.num_experts, min(moe.top_k, moe.num_experts)
        touched = e * (1.0 - (1.0 - k / e) ** batch_size)
        expert = 3 * h * moe.intermediate_size
        per_layer = e * h + round(touched * expert) + moe.num_shared_experts * expert
        elems["moe"] = len(moe_layers) * per_layer
    return {op: n * dtype_bytes for op, n in elems.items()}


def bandwidth_bytes_per_s(hardware: str) -> tuple[float, Hardware]:
    """The achievable memory bandwidth of a hardware target, bytes/s: the catalogue's peak ×
    its achievable fraction (:mod:`kiln.cost_model.hardware`; the ``cpu`` entry is an assumed
    sustained 20 GB/s for a 2-vCPU VM, documented there). Returns it with the entry.

    Raises:
        kiln.common.errors.NotFound: ``hardware`` is not in the catalogue.
    """
    entry = get_hardware(hardware)
    return entry.achievable_bandwidth_bytes_per_s, entry


def roofline_ms(bytes_by_op: dict[str, int], bandwidth: float) -> dict[str, float]:
    """Each op's floor, ms per decode step: bytes / ``bandwidth`` (bytes/s, > 0).

    Raises:
        ValueError: a bandwidth that is not positive.
    """
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    return {op: n / bandwidth * 1e3 for op, n in bytes_by_op.items()}
