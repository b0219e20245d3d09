"""Bytes one decode step reads: the weights it touches (all but an untied embedding table and
the routed experts no token picks) and the KV cache of its batch; the bandwidth limit they set.
Used by the roofline and by the baselines table's limit column."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.workloads.config import ModelConfig


@dataclass(frozen=True)
class DecodeStepBytes:
    """Bytes one decode step reads: ``weights`` (once per step), ``kv`` (0 when ``context`` is 0,
    unknown) at ``batch`` and ``kv_bytes_per_token`` over the layers held.
    """

    weights: float
    kv: float
    batch: int
    context: int
    kv_bytes_per_token: float

    @property
    def total(self) -> float:
        """``weights + kv``, bytes per decode step."""
        return self.weights + self.kv

    def limit_tokens_per_s(self, bandwidth_bytes_per_s: float) -> float:
        """``batch x bandwidth / (weights + kv)`` tokens/s (0 when no bytes are read)."""
        return self.batch * bandwidth_bytes_per_s / self.total if self.total > 0 else 0.0


def decode_kv_bytes(batch: int, context: int, kv_bytes_per_token: float) -> float:
    """``batch x context x kv_bytes_per_token``: KV-cache bytes one decode step reads."""
    return float(batch * context * kv_bytes_per_token)


def decode_step_bytes(
    weights_bytes: float, batch: int, context: int, kv_bytes_per_token: float
) -> DecodeStepBytes:
    """The weights once plus :func:`decode_kv_bytes`; ``context`` 0 gives the weights alone."""
    kv = decode_kv_bytes(batch, context, kv_bytes_per_token)
    return DecodeStepBytes(float(weights_bytes), kv, batch, context, float(kv_bytes_per_token))


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
