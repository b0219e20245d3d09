"""Ops: named, swappable implementations of the decoder's building blocks.

Importing this package registers the built-in implementations (one module per op family, each
with a plain-PyTorch ``reference``); :mod:`kiln.ops.registry` looks them up by name.
"""

from kiln.ops import (
    attention,
    embedding,
    lm_head,
    mlp,
    moe,
    o_proj,
    qkv_proj,
    rms_norm,
    rope,
    sampler,
)

__all__ = [
    "attention",
    "embedding",
    "lm_head",
    "mlp",
    "moe",
    "o_proj",
    "qkv_proj",
    "rms_norm",
    "rope",
    "sampler",
]
