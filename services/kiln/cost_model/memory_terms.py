"""Device memory a plan needs beyond its weights and KV cache: the activation and logits
workspace and the CUDA-graph pool of the decode graphs, bytes per device (estimates)."""

from __future__ import annotations

from kiln.cost_model.sharding import Parallelism, replica_batch
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import DTYPE_BYTES, ModelConfig

PREFILL_CHUNK_TOKENS = 8192
"""Largest prefill the workspace estimate provisions for at once, tokens (an assumption in line with
vLLM's and SGLang's chunked-prefill budgets).
"""


def workspace_bytes(
    cfg: ModelConfig, plan: Parallelism, point: OperatingPoint, adtype: str
) -> float:
    """Activation and logits workspace on one device, bytes (an estimate):
    ``min(ISL, 8192) x widest per-token activations of a layer x act bytes + b x V/tp x 4``
    (b: the replica's batch).
    """
    chunk = min(point.isl, PREFILL_CHUNK_TOKENS)
    logits = replica_batch(point.batch_size, plan.dp) * cfg.vocab_size / plan.tp * 4
    return chunk * token_activations(cfg, plan) * DTYPE_BYTES[adtype] + logits


def token_activations(cfg: ModelConfig, plan: Parallelism) -> float:
    """The widest activations one token has live inside a layer on one device, elements:
    ``3h + (heads + 2 kv heads) x head_dim / tp + FFN (2 x intermediate / tp; MoE: top_k x
    (h + 2 x expert intermediate / expert tp) when wider)``."""
    h = cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim / plan.tp
    ffn = 2 * cfg.intermediate_size / plan.tp
    if cfg.moe is not None:
        m = cfg.moe
        ffn = max(ffn, m.top_k * (h + 2 * m.intermediate_size / plan.expert_tp))
    return 3 * h + qkv + ffn


def graph_pool_bytes(
    cfg: ModelConfig, plan: Parallelism, point: OperatingPoint, adtype: str
) -> float:
    """The CUDA-graph memory pool of the decode graphs on one device, bytes: the largest
    captured batch's (the replica's b) live activations and float32 logits, ``b x widest
    activations x act bytes + b x V/tp x 4`` (captured graphs share one pool)."""
    b = replica_batch(point.batch_size, plan.dp)
    return b * token_activations(cfg, plan) * DTYPE_BYTES[adtype] + b * cfg.vocab_size / plan.tp * 4
