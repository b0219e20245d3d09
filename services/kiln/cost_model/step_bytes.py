"""Bytes one decode step reads: the weights it touches (all but an untied embedding table and
the routed experts no token picks) and the KV cache its batch's attention reads; the bandwidth
limit they set. Used by the roofline, the baselines table's limit column and the benchmarks.

The KV a step reads is :func:`kiln.cost_model.attention_span.decode_kv_read_bytes`: per layer
the tokens its attention attends (sliding-window layers their window, GLM-5's sparse layers the
indexer's top-k latents plus every token's indexer key), not the whole cache it holds
(:func:`held_kv_bytes_per_token`). :func:`decode_step_bytes_for` is the one entry point for a
model; :func:`decode_kv_bytes` is the dense formula (every layer reads the whole context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.cost_model.attention_span import decode_kv_read_bytes, describe, is_dense
from kiln.workloads.config import ModelConfig


@dataclass(frozen=True)
class DecodeStepBytes:
    """Bytes one decode step reads: ``weights`` (once per step), ``kv`` (0 when ``context`` is 0,
    unknown) at ``batch`` sequences of ``context`` tokens; ``kv_bytes_per_token``: the KV one
    token holds over the layers held (every layer's, :func:`held_kv_bytes_per_token`);
    ``kv_span``: how the layers' attention spans cut ``kv`` below ``batch x context x
    kv_bytes_per_token`` ("" when they do not: every layer attends the whole context).
    """

    weights: float
    kv: float
    batch: int
    context: int
    kv_bytes_per_token: float
    kv_span: str = ""

    @property
    def total(self) -> float:
        """``weights + kv``, bytes per decode step."""
        return self.weights + self.kv

    def limit_tokens_per_s(self, bandwidth_bytes_per_s: float) -> float:
        """``batch x bandwidth / (weights + kv)`` tokens/s (0 when no bytes are read)."""
        return self.batch * bandwidth_bytes_per_s / self.total if self.total > 0 else 0.0


def decode_kv_bytes(batch: int, context: int, kv_bytes_per_token: float) -> float:
    """``batch x context x kv_bytes_per_token``: the KV-cache bytes a decode step reads when
    every layer attends the whole context (the dense formula; a model with sliding or sparse
    layers reads less: :func:`kiln.cost_model.attention_span.decode_kv_read_bytes`)."""
    return float(batch * context * kv_bytes_per_token)


def decode_step_bytes(
    weights_bytes: float,
    batch: int,
    context: int,
    kv_bytes_per_token: float,
    *,
    kv_bytes: float | None = None,
    kv_span: str = "",
) -> DecodeStepBytes:
    """The weights once plus the KV read: ``kv_bytes`` when given (the step's KV read, bytes,
    e.g. :func:`~kiln.cost_model.attention_span.decode_kv_read_bytes`; ``kv_span`` says how it
    was cut), else :func:`decode_kv_bytes`; ``context`` 0 gives the weights alone."""
    if context <= 0:
        kv = 0.0
    elif kv_bytes is not None:
        kv = float(kv_bytes)
    else:
        kv = decode_kv_bytes(batch, context, kv_bytes_per_token)
    return DecodeStepBytes(
        float(weights_bytes), kv, batch, context, float(kv_bytes_per_token), kv_span
    )


def decode_step_bytes_for(
    cfg: ModelConfig,
    weights_bytes: float,
    batch: int,
    context: int,
    dtype: str = "bfloat16",
    layers: int = 0,
) -> DecodeStepBytes:
    """What one decode step of ``cfg`` reads: ``weights_bytes`` once plus the KV its attention
    reads (:func:`~kiln.cost_model.attention_span.decode_kv_read_bytes`) for ``batch``
    sequences at ``context`` tokens in ``dtype`` over the first ``layers`` layers (0: all);
    ``context`` 0 gives the weights alone. The roofline's ``decode.kv_bytes`` at one shard."""
    held = held_kv_bytes_per_token(cfg, dtype, layers)
    kv = decode_kv_read_bytes(cfg, batch, context, dtype, layers=layers)
    span = "" if is_dense(cfg, layers) else describe(cfg, layers=layers)
    return decode_step_bytes(weights_bytes, batch, context, held, kv_bytes=kv, kv_span=span)


def expected_experts_read(
    num_experts: int, top_k: int, batch: int, shares: Sequence[float] | None = None
) -> float:
    """Expected distinct experts one MoE layer reads for ``batch`` independent tokens:
    ``sum_e 1 - (1 - min(1, top_k x share_e)) ** batch``, shares uniform when None.
    """
    probs = shares if shares is not None else [1.0 / num_experts] * num_experts
    return math.fsum(1.0 - (1.0 - min(1.0, top_k * p)) ** batch for p in probs)


def moe_unread_expert_bytes(
    cfg: ModelConfig,
    dtype_bytes: int,
    batch: int,
    *,
    layers: int = 0,
    shares: Sequence[float] | None = None,
) -> float:
    """Bytes of routed experts a step at ``batch`` is expected not to read over the first
    ``layers`` layers (0: all); 0 for a dense model.
    """
    m = cfg.moe
    if m is None:
        return 0.0
    held = layers if 0 < layers < cfg.num_hidden_layers else cfg.num_hidden_layers
    moe_layers = cfg.moe_layers_in(range(held))
    expert = 3 * cfg.hidden_size * m.intermediate_size * dtype_bytes
    unread = m.num_experts - expected_experts_read(m.num_experts, m.top_k, batch, shares)
    return moe_layers * max(0.0, unread) * expert


def weights_read_bytes(
    cfg: ModelConfig,
    held_bytes: float,
    dtype_bytes: int,
    batch: int,
    *,
    layers: int = 0,
    shares: Sequence[float] | None = None,
) -> float:
    """Weight bytes a step at ``batch`` reads of ``held_bytes``: all but an untied embedding
    table and the experts expected untouched (first ``layers`` layers, 0: all).
    """
    unread = moe_unread_expert_bytes(cfg, dtype_bytes, batch, layers=layers, shares=shares)
    if not cfg.tie_word_embeddings:
        unread += (cfg.vocab_size - batch) * cfg.hidden_size * dtype_bytes
    return max(0.0, held_bytes - unread)


def held_kv_bytes_per_token(cfg: ModelConfig, dtype: str, layers: int = 0) -> int:
    """KV bytes of one token in ``dtype`` over the first ``layers`` layers (0 or too many: all)."""
    if 0 < layers < cfg.num_hidden_layers:
        cfg = cfg.with_layers(layers)
    return cfg.kv_bytes_per_token(dtype)
