"""How a parallelism plan splits a model's weights, KV cache and expert traffic over devices
(after vLLM/SGLang, Megatron-style TP):

- TP splits attention by heads (k, v by ``min(tp, kv_heads)``, replicated beyond), the dense FFN
  by intermediate dim, embedding and LM head by vocabulary; norms and router are replicated. MLA
  replicates the down projections and the latent cache, splits the up projections by heads.
- The MoE group: one layer's routed experts are spread over ``ep x moe_tp`` devices, ``ep`` ways
  by expert and ``moe_tp`` ways inside each expert. By default ``moe_tp = tp / ep`` when
  ``ep < tp`` (each expert split inside the TP group), else 1, so the group is ``max(tp, ep)``.
  Shared experts split by ``tp``.
- Attention DP: when the MoE group is wider than ``tp`` it spans ``ep x moe_tp / tp`` DP
  replicas. Attention (and the dense FFN, shared experts, embedding and head) stays per replica:
  replicated over the replicas, split by ``tp`` inside one, each replica holding the KV cache of
  its own ``ceil(B / dp)`` sequences; the routed experts are split over the whole group, which
  sees every replica's tokens (SGLang ``--enable-dp-attention``, vLLM DP + EP; ``moe_tp`` above
  the default is SGLang's MoE TP over ``tp_size = tp x dp`` and vLLM's DP without EP).
- PP: vLLM's split (``get_pp_indices``): ``L // pp`` consecutive layers a stage, the remainder
  one each to the stages before the last, the second-to-last first, so stages hold
  ``ceil(L / pp)`` or ``floor(L / pp)`` layers (DeepSeek-V3's 61 over pp=2: 31 and 30); the
  embedding on the first, final norm and LM head on the last (a tied head copied when
  ``pp > 1``). The largest stage sets a device's weights and KV cache.
- DP replicates the tp x pp model; DCP splits replicated KV along the sequence.
- KV dtype: the plan's ``kv_dtype`` (an FP8 cache halves a BF16 one), else the activations'.

A plan uses ``tp x pp x dp`` devices. Element counts are floats: an indivisible plan is still
costed, then pruned.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kiln.workloads.config import ModelConfig, MoEConfig

FP8 = "float8_e4m3fn"
"""The FP8 dtype an FP8 KV cache (and FP8 weights) use."""


@dataclass(frozen=True)
class Parallelism:
    """A parallelism plan: degrees of TP, EP, DP, PP and DCP (each ≥ 1), the TP degree inside
    one routed expert ``moe_tp`` (0: the default, see :attr:`expert_tp`) and the KV-cache dtype
    ``kv_dtype`` ("": the activation dtype). ``moe_tp`` equal to the default reads as 0.
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    dcp: int = 1
    moe_tp: int = 0
    kv_dtype: str = ""

    def __post_init__(self) -> None:
        if self.moe_tp and self.moe_tp == self.default_moe_tp:
            object.__setattr__(self, "moe_tp", 0)

    @property
    def devices(self) -> int:
        """Devices the plan occupies: tp × pp × dp (EP and DCP re-use those ranks)."""
        return self.tp * self.pp * self.dp

    @property
    def default_moe_tp(self) -> int:
        """TP inside one expert when ``moe_tp`` is unset: tp / ep when ep < tp, else 1."""
        return max(1, self.tp // max(1, self.ep))

    @property
    def expert_tp(self) -> int:
        """TP degree inside one routed expert: ``moe_tp``, else :attr:`default_moe_tp`."""
        return self.moe_tp or self.default_moe_tp

    @property
    def expert_shards(self) -> int:
        """Devices one layer's routed experts are spread over (the MoE group): ep × moe_tp, by
        default max(tp, ep)."""
        return self.ep * self.moe_tp if self.moe_tp else max(self.tp, self.ep)

    @property
    def replicas_per_ep_group(self) -> int:
        """DP replicas whose tokens meet in one MoE group: (ep × moe_tp) / tp, at least 1."""
        return max(1, self.expert_shards // max(1, self.tp))

    @property
    def attention_dp(self) -> bool:
        """Whether the MoE group spans DP replicas (attention per replica, experts over all)."""
        return self.replicas_per_ep_group > 1

    def label(self) -> str:
        """Short name, e.g. ``tp8 ep8 dp1 pp1 dcp1`` (``etp4`` for a ``moe_tp`` set, ``kv fp8``
        for an FP8 KV cache)."""
        out = f"tp{self.tp} ep{self.ep} dp{self.dp} pp{self.pp} dcp{self.dcp}"
        if self.moe_tp:
            out += f" etp{self.moe_tp}"
        if self.kv_dtype:
            out += f" kv {kv_dtype_name(self.kv_dtype)}"
        return out


def kv_dtype_name(dtype: str) -> str:
    """The short name engines use for a KV dtype: ``fp8`` for FP8, else the dtype."""
    return "fp8" if dtype.startswith("float8") else dtype


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
        # GLM-5's sparse-attention indexer: small, held whole on every rank.
        index = cfg.dsa.params(h, m.q_lora_rank or 0) if cfg.dsa is not None else 0
        return q + kv_down + kv_up + o + index
    kv_ranks = min(tp, cfg.num_key_value_heads)
    q_o = 2 * h * heads * d / tp
    kv = 2 * h * cfg.num_key_value_heads * d / kv_ranks
    bias = 0.0
    if cfg.attention_bias:
        bias = heads * d / tp + 2 * cfg.num_key_value_heads * d / kv_ranks
    norms: float = 2 * d if cfg.qk_norm else 0
    if cfg.qk_norm and cfg.qk_norm_type == "per_layer":  # over the whole q and k (MiniMax-M2)
        norms = heads * d / tp + cfg.num_key_value_heads * d / kv_ranks
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
    """Layers of pipeline stage ``stage`` (0-based), as vLLM's ``get_pp_indices`` splits them:
    ``L // pp`` each, the remainder one more each on stages ``pp-1-r .. pp-2`` (r = L mod pp; the
    last stage, which holds the head, never takes one)."""
    return _stage_range(cfg.num_hidden_layers, pp, stage)


def _stage_range(layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(layers, pp)
    first_big = pp - 1 - extra
    start = stage * base + max(0, stage - first_big)
    return range(start, start + base + (1 if first_big <= stage < pp - 1 else 0))


def largest_stage_layers(cfg: ModelConfig, pp: int) -> int:
    """Layers of the largest pipeline stage: ``ceil(L / pp)`` (1 when pp > L)."""
    return -(-cfg.num_hidden_layers // max(1, pp))


def stored_weights_per_device(
    cfg: ModelConfig, plan: Parallelism, kinds: tuple[LayerShard, LayerShard] | None = None
) -> float:
    """Weights the most loaded device stores, elements (largest stage, plus embedding or head);
    ``kinds``: :func:`layer_kinds` of the plan, when already known."""
    dense, moe = kinds or layer_kinds(cfg, plan)
    dense_layers = cfg.moe.dense_layers if cfg.moe is not None else None
    best = 0.0
    for size, n_moe, first, last in _stage_profiles(cfg.num_hidden_layers, dense_layers, plan.pp):
        total = n_moe * moe.stored + (size - n_moe) * dense.stored
        if first:
            total += vocab_shard(cfg, plan.tp)
        if last:
            total += cfg.hidden_size
            if not (cfg.tie_word_embeddings and first):
                total += vocab_shard(cfg, plan.tp)
        best = max(best, total)
    return best


@lru_cache(maxsize=1024)
def _stage_profiles(
    layers: int, dense_layers: tuple[int, ...] | None, pp: int
) -> tuple[tuple[int, int, bool, bool], ...]:
    """The distinct (layers, MoE layers, first, last) of the ``pp`` stages of a model of
    ``layers`` layers whose dense ones are ``dense_layers`` (None: no MoE), so a plan costs
    O(distinct stages), not O(pp), once the split is known."""
    dense = frozenset(dense_layers or ())
    out = set()
    for stage in range(pp):
        span = _stage_range(layers, pp, stage)
        n_moe = 0 if dense_layers is None else sum(i not in dense for i in span)
        out.add((len(span), n_moe, stage == 0, stage == pp - 1))
    return tuple(sorted(out))


def layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers) of the whole model."""
    moe = cfg.moe_layers_in(range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers - moe, moe


def layer_kinds(cfg: ModelConfig, plan: Parallelism) -> tuple[LayerShard, LayerShard]:
    """(dense layer shard, MoE layer shard) on one device; the absent kind is all zeros."""
    dense: int | None = 0
    moe: int | None = None
    if cfg.moe is not None:  # the first layer of each kind, without a walk over all layers
        listed = cfg.moe.dense_layers
        dense = min(listed) if listed else None
        moe = next(i for i in range(len(listed) + 1) if cfg.is_moe_layer(i))
        if moe >= cfg.num_hidden_layers:
            moe = None
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
    """KV-cache bytes one device holds for ``tokens`` cached tokens (its replica's batch x
    context) in ``kv_dtype``, over the largest stage's ``ceil(L / pp)`` layers."""
    fraction = largest_stage_layers(cfg, plan.pp) / cfg.num_hidden_layers
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


def replica_batch(batch: int, dp: int) -> int:
    """Sequences one of ``dp`` replicas decodes when they share ``batch``: ceil(batch / dp)."""
    return max(1, -(-batch // max(1, dp)))
