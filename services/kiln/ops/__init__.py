"""Ops: named, swappable implementations of the decoder's building blocks.

Importing this package registers the built-in implementations (one module per op family, each
with a plain-PyTorch ``reference``; the Triton-backed ones in ``*_triton`` / ``linear_triton`` /
``quantized_linear``, which import Triton only when first called); :mod:`kiln.ops.registry` looks
them up by name.
"""

from kiln.ops import (
    attention,
    attention_triton,
    dsa_indexer,
    embedding,
    linear_triton,
    lm_head,
    mla,
    mlp,
    moe,
    moe_triton,
    o_proj,
    qkv_proj,
    quantized_linear,
    rms_norm,
    rms_norm_triton,
    rope,
    sampler,
)

__all__ = [
    "attention",
    "attention_triton",
    "dsa_indexer",
    "embedding",
    "linear_triton",
    "lm_head",
    "mla",
    "mlp",
    "moe",
    "moe_triton",
    "o_proj",
    "qkv_proj",
    "quantized_linear",
    "rms_norm",
    "rms_norm_triton",
    "rope",
    "sampler",
]
