"""What each layer's attention reads and computes: the one place the cost model and the
bandwidth limit learn that a layer attends only part of the context.

A layer's *span* is the most tokens one query attends:

- full layers: every earlier token (``None``): ``context`` at decode;
- sliding-window layers (gpt-oss's ``sliding_layers``): ``sliding_window`` tokens, the query's
  own included (``p - window < s <= p``, :mod:`kiln.workloads.gpt_oss`): ``min(context,
  window)``;
- sparse layers (GLM-5's DSA, :mod:`kiln.workloads.glm_moe_dsa`; every layer of such a model):
  the indexer's ``topk`` picks: ``min(context, topk)``. The indexer itself scores *every*
  earlier token (``n_heads`` heads of ``head_dim``) and its keys are read for all of them.

What a decode step reads and computes follows from the span; what the cache *holds* does not
(kiln's cache keeps the whole context in every layer: ``ModelConfig.kv_bytes_per_token``).

Contract (all functions pure; sizes in elements, bytes or FLOPs as named; ``layers`` picks the
layers counted: an int ``n`` the first ``n`` (0 or ``n >= L``: all, as
:func:`kiln.cost_model.step_bytes.held_kv_bytes_per_token`), a range those):

- :func:`decode_kv_read_bytes`: KV-cache bytes one decode step of ``batch`` sequences at
  ``context`` tokens reads in ``dtype``: per layer ``attended x`` the attended part of a token's
  entry (K and V of every KV head; MLA: latent + rope key) ``+ context x`` the indexer key (DSA),
  summed, times ``batch``; divided by ``shards`` (ways one layer's cache is split) it is one
  device's.
- :func:`decode_attention_flops`: ``batch x sum over layers 2 x heads/tp x (dqk + dv) x attended
  / dcp`` (QK and PV, 2 FLOPs a multiply-add; MLA absorbed: dqk = latent + rope, dv = latent), plus
  for DSA the indexer's ``2 x n_heads x head_dim x context / dcp`` a layer (its heads are not
  split by tp: vLLM runs the indexer replicated).
- :func:`prefill_attention_flops`: a causal prefill of ``isl`` tokens, ``sum over layers 2 x
  causal pairs x heads/tp x (dqk + dv)`` (MLA expanded), pairs within the span
  (:func:`causal_pairs`); DSA adds the indexer's ``2 x n_heads x head_dim`` over all causal
  pairs.

Not counted: the indexer's top-k selection and ReLU-weighted head sum, softmax, masks.
A model with every layer full gives exactly the dense formulas (``b x ctx x L x ...``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.workloads.config import DTYPE_BYTES, ModelConfig

FULL, SLIDING, SPARSE = "full", "sliding", "sparse"
"""Layer kinds: attends every earlier token / a sliding window / the DSA indexer's top-k."""


@dataclass(frozen=True)
class LayerGroup:
    """``layers`` layers of one ``kind`` attending at most ``span`` tokens (None: all)."""

    kind: str
    span: int | None
    layers: int

    def attended(self, context: int) -> int:
        """Tokens one query attends at ``context`` tokens of cache: ``min(context, span)``."""
        return context if self.span is None else min(context, self.span)


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[str, int | None]:
    """(kind, span) of layer ``layer`` (0-based): see the module docs."""
    if cfg.dsa is not None:
        return SPARSE, cfg.dsa.topk
    if cfg.sliding_window is not None and layer in cfg.sliding_layers:
        return SLIDING, cfg.sliding_window
    return FULL, None


def attended_tokens(cfg: ModelConfig, layer: int, context: int) -> int:
    """Tokens layer ``layer``'s attention attends for one query at ``context`` tokens."""
    _, span = layer_kind(cfg, layer)
    return context if span is None else min(context, span)


def _range(cfg: ModelConfig, layers: int | range) -> range:
    if isinstance(layers, range):
        return layers
    return range(layers if 0 < layers < cfg.num_hidden_layers else cfg.num_hidden_layers)


def layer_groups(cfg: ModelConfig, layers: int | range = 0) -> tuple[LayerGroup, ...]:
    """The counted layers grouped by (kind, span), in order of first appearance."""
    counts: dict[tuple[str, int | None], int] = {}
    for i in _range(cfg, layers):
        key = layer_kind(cfg, i)
        counts[key] = counts.get(key, 0) + 1
    return tuple(LayerGroup(kind, span, n) for (kind, span), n in counts.items())


def index_elements_per_layer(cfg: ModelConfig) -> int:
    """Cache elements of one token's indexer key in one layer (DSA: ``index_head_dim``; else 0),
    the part read for every context token whatever the span."""
    return cfg.dsa.head_dim if cfg.dsa is not None and cfg.mla is not None else 0


def attended_elements_per_layer(cfg: ModelConfig) -> int:
    """Cache elements of one token in one layer read only when attended: K and V of every KV
    head, or MLA's latent + rope key (``kv_elements_per_layer`` less the indexer key)."""
    return cfg.kv_elements_per_layer() - index_elements_per_layer(cfg)


def decode_kv_read_bytes(
    cfg: ModelConfig,
    batch: int,
    context: int,
    dtype: str = "bfloat16",
    *,
    layers: int | range = 0,
    shards: float = 1,
) -> float:
    """KV-cache bytes one decode step reads (module docs): ``batch`` sequences at ``context``
    tokens in ``dtype`` over ``layers``, one of ``shards`` ways the cache is split. With every
    layer full: ``batch x context x (kv_bytes_per_token / shards)``."""
    size = DTYPE_BYTES[dtype]
    attended, index = attended_elements_per_layer(cfg), index_elements_per_layer(cfg)
    total = 0.0
    for g in layer_groups(cfg, layers):
        total += batch * g.attended(context) * (attended * g.layers * size / shards)
        if index:
            total += batch * context * (index * g.layers * size / shards)
    return total


def attention_dims(cfg: ModelConfig, decode: bool) -> tuple[int, int]:
    """(score dim, value dim) per attention head for FLOP counting (MLA: absorbed on decode,
    ``kv_lora_rank + qk_rope_head_dim`` and ``kv_lora_rank``; expanded on prefill)."""
    if cfg.mla is not None:
        m = cfg.mla
        if decode:
            return m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return cfg.head_dim, cfg.head_dim


def decode_attention_flops(
    cfg: ModelConfig,
    batch: int,
    context: int,
    *,
    tp: int = 1,
    dcp: int = 1,
    layers: int | range = 0,
) -> float:
    """Attention FLOPs of one decode step on one rank (module docs): ``batch`` queries at
    ``context`` tokens, heads split by ``tp``, context by ``dcp``."""
    heads_per_rank = cfg.num_attention_heads / tp
    dqk, dv = attention_dims(cfg, decode=True)
    total = 0.0
    for g in layer_groups(cfg, layers):
        total += batch * g.attended(context) * g.layers * heads_per_rank * 2 * (dqk + dv) / dcp
        if cfg.dsa is not None:
            total += batch * context * g.layers * 2 * cfg.dsa.n_heads * cfg.dsa.head_dim / dcp
    return total


def causal_pairs(tokens: int, span: int | None = None) -> float:
    """(query, key) pairs a causal pass over ``tokens`` attends with each query seeing at most
    ``span`` keys (None: all), in the continuous form of the dense formula: ``tokens² / 2`` up
    to the span, then ``span x tokens - span² / 2`` (linear in ``tokens`` past it)."""
    if span is None or tokens <= span:
        return tokens * tokens / 2
    return span * tokens - span * span / 2


def prefill_attention_flops(
    cfg: ModelConfig, isl: int, *, tp: int = 1, layers: int | range = 0
) -> float:
    """Attention FLOPs of a causal prefill of ``isl`` tokens on one rank (module docs), heads
    split by ``tp``. With every layer full: ``L x isl x isl x heads/tp x (dqk + dv)``."""
    heads_per_rank = cfg.num_attention_heads / tp
    dqk, dv = attention_dims(cfg, decode=False)
    total = 0.0
    for g in layer_groups(cfg, layers):
        total += g.layers * (2 * causal_pairs(isl, g.span)) * heads_per_rank * (dqk + dv)
        if cfg.dsa is not None:
            index = 2 * cfg.dsa.n_heads * cfg.dsa.head_dim
            total += g.layers * causal_pairs(isl) * index
    return total


def is_dense(cfg: ModelConfig, layers: int | range = 0) -> bool:
    """Every counted layer attends the whole context (the dense formulas hold)."""
    return all(g.kind == FULL for g in layer_groups(cfg, layers))


def describe(cfg: ModelConfig, context: int | None = None, layers: int | range = 0) -> str:
    """The spans in words for ``Explain``, e.g. ``12 sliding layers (window 128) × 128 tokens +
    12 full layers × 4,096 tokens`` (``context`` None: the spans alone)."""
    parts = []
    for g in layer_groups(cfg, layers):
        what = {
            FULL: "full layers",
            SLIDING: f"sliding layers (window {g.span or 0:,})",
            SPARSE: f"sparse layers (DSA top-{g.span or 0:,})",
        }[g.kind]
        part = f"{g.layers} {what}"
        if context is not None:
            part += f" × {g.attended(context):,} tokens"
            if index_elements_per_layer(cfg):
                part += f" + indexer keys of all {context:,}"
        parts.append(part)
    return " + ".join(parts)
