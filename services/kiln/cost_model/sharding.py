"""How a parallelism plan splits a model's weights, KV cache and expert traffic over devices
(after vLLM/SGLang, Megatron-style TP):

- TP splits attention by heads (k, v by ``min(tp, kv_heads)``, replicated beyond), the dense FFN
  by intermediate dim, embedding and LM head by vocabulary; norms and router are replicated. MLA
  replicates the down projections and the latent cache, splits the up projections by heads.
- EP splits routed experts over ``max(tp, ep)`` devices (``ep < tp`` splits each expert by
  ``tp / ep``); shared experts split by ``tp``.
- PP: ``L / pp`` consecutive layers a stage; the embedding on the first, final norm and LM head
  on the last (a tied head copied when ``pp > 1``).
- DP replicates the tp x pp model; DCP splits replicated KV along the sequence.

A plan uses ``tp x pp x dp`` devices. Element counts are floats: an indivisible plan is still
costed, then pruned.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.workloads.config import ModelConfig, MoEConfig


@dataclass(frozen=True)
class Parallelism:
    """A parallelism plan: degrees of TP, EP, DP, PP and DCP (each ≥ 1)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    dcp: int = 1

    @property
    def devices(self) -> int:
        """Devices the plan occupies: tp × pp × dp (EP and DCP re-use those ranks)."""
        return self.tp * self.pp * self.dp

    @property
    def expert_shards(self) -> int:
        """Devices one layer's routed experts are spread over: max(tp, ep)."""
        return max(self.tp, self.ep)

    @property
    def expert_tp(self) -> int:
        """TP degree inside one expert: tp / ep when ep < tp, else 1."""
        return max(1, self.tp // self.ep)

    @property
    def replicas_per_ep_group(self) -> int:
        """DP replicas whose tokens meet in one EP group: ep / tp when ep > tp, else 1."""
        return max(1, self.ep // self.tp)

    def label(self) -> str:
        """Short name, e.g. ``tp8 ep8 dp1 pp1 dcp1``."""
        return f"tp{self.tp} ep{self.ep} dp{self.dp} pp{self.pp} dcp{self.dcp}"


@dataclass(frozen=True)
class LayerShard:
    """Weights of one decoder layer held by one device, elements; ``routed_expert`` is one routed
    expert's slice, ``routed_experts_held`` all the routed experts it stores.
    """

    attention: float
    norms: float
    dense_ffn: float
    router: float
    shared_experts: float
    routed_expert: float
    routed_experts_held: float

    @property
    def always_read(self) -> float:
        """Weights every decode step reads whatever the routing, elements."""
        return self.attention + self.norms + self.dense_ffn + self.router + self.shared_experts

    @property
    def stored(self) -> float:
        """All weights the device stores for this layer, elements."""
        return self.always_read + self.routed_experts_held


def attention_shard(cfg: ModelConfig, tp: int) -> float:
    """Attention weights of one layer on one TP rank, elements
    (``ModelConfig.attention_params()`` at ``tp=1``).
    """
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    if cfg.mla is not None:
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk / tp
        else:
            q = h * heads * qk / tp
        kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) / tp
        o = heads * m.v_head_dim * h / tp
        return q + kv_down + kv_up + o
    kv_ranks = min(tp, cfg.num_key_value_heads)
    q_o = 2 * h * heads * d / tp
    kv = 2 * h * cfg.num_key_value_heads * d / kv_ranks
    bias = 0.0
    if cfg.attention_bias:
        bias = heads * d / tp + 2 * cfg.num_key_value_heads * d / kv_ranks
    norms = 2 * d if cfg.qk_norm else 0
    return q_o + kv + bias + norms


def layer_shard(cfg: ModelConfig, layer: int, plan: Parallelism) -> LayerShard:
    """Weights of layer ``layer`` held by one device under ``plan``, elements."""
    h = cfg.hidden_size
    attn = attention_shard(cfg, plan.tp)
    norms = 2 * h
    if not cfg.is_moe_layer(layer):
        dense = 3 * h * cfg.intermediate_size / plan.tp
        return LayerShard(attn, norms, dense, 0.0, 0.0, 0.0, 0.0)
    m = cfg.moe
    assert m is not None
    expert = 3 * h * m.intermediate_size
    one = expert / plan.expert_tp
    return LayerShard(
        attention=attn,
        norms=norms,
        dense_ffn=0.0,
        router=h * m.num_experts,
        shared_experts=m.num_shared_experts * expert / plan.tp,
        routed_expert=one,
        routed_experts_held=m.num_experts / plan.ep * one,
    )


def vocab_shard(cfg: ModelConfig, tp: int) -> float:
    """One vocab-parallel shard of the embedding (or of the LM head), elements: V·h / tp."""
    return cfg.vocab_size * cfg.hidden_size / tp


def stage_layers(cfg: ModelConfig, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage`` (0-based); the last takes the remainder."""
    per = cfg.num_hidden_layers // pp
    end = cfg.num_hidden_layers if stage == pp - 1 else (stage + 1) * per
    return range(stage * per, end)


def stored_weights_per_device(cfg: ModelConfig, plan: Parallelism) -> float:
    """Weights the most loaded device stores, elements (largest stage, plus embedding or head)."""
    dense, moe = layer_kinds(cfg, plan)
    best = 0.0
    # With more stages than layers, every stage but the last is empty: only the first (the
    # embedding) and the last (every layer, the head) can be the most loaded; O(1), not O(pp).
    some = cfg.num_hidden_layers // plan.pp
    for stage in range(plan.pp) if some else sorted({0, plan.pp - 1}):
        layers = stage_layers(cfg, plan.pp, stage)
        n_moe = cfg.moe_layers_in(layers)
        total = n_moe * moe.stored + (len(layers) - n_moe) * dense.stored
        first, last = stage == 0, stage == plan.pp - 1
        if first:
            total += vocab_shard(cfg, plan.tp)
        if last:
            total += cfg.hidden_size
            if not (cfg.tie_word_embeddings and first):
                total += vocab_shard(cfg, plan.tp)
        best = max(best, total)
    return best


def layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers) of the whole model."""
    moe = cfg.moe_layers_in(range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers - moe, moe


def layer_kinds(cfg: ModelConfig, plan: Parallelism) -> tuple[LayerShard, LayerShard]:
    """(dense layer shard, MoE layer shard) on one device; the absent kind is all zeros."""
    dense = next((i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)), None)
    moe = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)), None)
    empty = LayerShard(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return (
        empty if dense is None else layer_shard(cfg, dense, plan),
        empty if moe is None else layer_shard(cfg, moe, plan),
    )


def kv_heads_for_sharding(cfg: ModelConfig) -> int:
    """``num_key_value_heads``, or 1 for MLA's shared latent."""
    return 1 if cfg.mla is not None else cfg.num_key_value_heads


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many TP ranks hold the same KV head: ``tp / min(tp, kv_heads)`` (≥ 1)."""
    return max(1, tp // min(tp, kv_heads_for_sharding(cfg)))


def kv_shards(cfg: ModelConfig, plan: Parallelism) -> int:
    """Ways one layer's KV cache is split: ``min(tp, kv_heads) × dcp``."""
    return min(plan.tp, kv_heads_for_sharding(cfg)) * plan.dcp


def kv_bytes_per_device(
    cfg: ModelConfig, plan: Parallelism, tokens: int, kv_dtype: str = "bfloat16"
) -> float:
    """KV-cache bytes one device holds for ``tokens`` cached tokens (batch x context)."""
    per = cfg.num_hidden_layers // plan.pp  # every stage but the last; the last the rest
    stage = max(per, cfg.num_hidden_layers - (plan.pp - 1) * per)
    fraction = stage / cfg.num_hidden_layers
    return tokens * cfg.kv_bytes_per_token(kv_dtype) * fraction / kv_shards(cfg, plan)


@dataclass(frozen=True)
class ExpertLoad:
    """Routed-expert load on the busiest EP rank of one MoE layer, tokens picking ``top_k``
    experts uniformly; the skew s applies pessimistically to the busiest rank (``p_hot = min(1,
    min(s, ep) x top_k / E)``).
    """

    tokens: float
    experts_per_rank: float
    p_hot: float
    distinct_experts: float
    assignments: float


def expert_load(moe: MoEConfig, plan: Parallelism, tokens: float, skew: float) -> ExpertLoad:
    """The busiest EP rank's expected distinct experts and assignments for ``tokens`` tokens."""
    n = moe.num_experts / plan.ep
    s = min(max(skew, 1.0), float(plan.ep))
    p_hot = min(1.0, s * moe.top_k / moe.num_experts)
    distinct = n * (1.0 - (1.0 - p_hot) ** tokens)
    return ExpertLoad(tokens, n, p_hot, distinct, tokens * n * p_hot)
