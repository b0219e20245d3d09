"""The memory roofline of each op of one decode step: the bytes it must move, over bandwidth.

Per op over the ``layers`` held, in elements times ``dtype_bytes``: ``qkv_proj``, ``o_proj``,
``mlp`` their weights (and biases); ``moe`` the router plus the experts expected touched by B·k
uniform choices, ``E·(1 - (1 - k/E)^B)``, and shared experts; ``attention`` the KV read,
``2·B·(C+1)·Hkv·d`` per layer; ``rms_norm`` the norm weights; ``embedding`` B rows; ``lm_head``
the whole ``V·H``; ``rope`` and ``sampler`` 0. Activations are left out.
"""

from __future__ import annotations

from kiln.cost_model.hardware import Hardware, get_hardware
from kiln.workloads.config import ModelConfig


def op_bytes(
    config: ModelConfig, *, layers: int, batch_size: int, context_len: int, dtype_bytes: int
) -> dict[str, int]:
    """Bytes each op must read in one decode step: op -> bytes (ops the model does not call
    absent).

    ``layers`` in 1..``num_hidden_layers``, ``batch_size`` >= 1, ``context_len`` >= 0 tokens
    already cached. ValueError on a bad count or an MLA model.
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
    """(achievable memory bandwidth in bytes/s, catalogue entry) of ``hardware``; NotFound if
    unknown.
    """
    entry = get_hardware(hardware)
    return entry.achievable_bandwidth_bytes_per_s, entry


def roofline_ms(bytes_by_op: dict[str, int], bandwidth: float) -> dict[str, float]:
    """Each op's floor, ms per step: bytes / ``bandwidth`` (bytes/s); ValueError unless positive."""
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    return {op: n / bandwidth * 1e3 for op, n in bytes_by_op.items()}
