"""What a decode step and a prefill's attention read and compute, per layer
(kiln.cost_model.attention_span): full layers the whole context, gpt-oss's sliding layers their
128-token window, GLM-5's sparse layers the indexer's top-2048 latents plus every token's
indexer key. Expected values are written out from the configs' own numbers (the JSON files), not
from the code under test; a dense model gives the dense formulas exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.baselines.table import Comparison
from kiln.cost_model import attention_span as span
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism
from kiln.cost_model.step_bytes import decode_kv_bytes, decode_step_bytes_for
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import load_config, parse_config

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
needs_models = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is absent")
H200 = get_hardware("h200")

LLAMA_1B: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
}  # fmt: skip
LLAMA = parse_config(LLAMA_1B, "llama-3.2-1b")


def raw(name: str) -> dict[str, Any]:
    return json.loads((MODELS / f"{name}.json").read_text())  # type: ignore[no-any-return]


# ------------------------------------------------------------------------- dense: unchanged
@pytest.mark.parametrize(("b", "ctx", "tp", "dcp"), [(1, 32768, 1, 1), (8, 3000, 4, 2)])
def test_a_dense_model_gives_the_dense_formulas(b: int, ctx: int, tp: int, dcp: int) -> None:
    kv_token = 16 * 2 * 8 * 64 * 2  # layers x K and V x 8 heads x 64 x bf16
    shards = min(tp, 8) * dcp
    assert span.decode_kv_read_bytes(LLAMA, b, ctx, shards=shards) == decode_kv_bytes(
        b, ctx, kv_token / shards
    )
    assert span.decode_kv_read_bytes(LLAMA, b, ctx, "float32") == b * ctx * 2 * kv_token
    heads = 32 / tp
    old_decode = b * ctx * 16 * heads * 2 * (64 + 64) / dcp
    assert span.decode_attention_flops(LLAMA, b, ctx, tp=tp, dcp=dcp) == old_decode
    old_prefill = 16 * ctx * ctx * heads * (64 + 64)
    assert span.prefill_attention_flops(LLAMA, ctx, tp=tp) == old_prefill
    assert span.is_dense(LLAMA) and span.describe(LLAMA, ctx) == f"16 full layers × {ctx:,} tokens"
    est = estimate(
        LLAMA, H200, OperatingPoint(batch_size=b, isl=ctx, context_len=ctx), Parallelism(tp=tp)
    )
    assert est.term("decode.kv_bytes").value == decode_kv_bytes(b, ctx, kv_token / min(tp, 8))
    assert "every layer attends the whole context" in est.term("decode.kv_bytes").source
    assert "sliding" not in est.term("decode.flops").source


# ------------------------------------------------------------------------- gpt-oss: sliding
@needs_models
def test_gpt_oss_at_4096_reads_about_half_the_dense_kv() -> None:
    cfg, r = load_config(MODELS / "gpt-oss-20b.json"), raw("gpt-oss-20b")
    window, kinds = r["sliding_window"], r["layer_types"]
    per_layer = 2 * r["num_key_value_heads"] * r["head_dim"] * 2  # K and V, bf16: 2,048 B
    sliding = kinds.count("sliding_attention")
    full = kinds.count("full_attention")
    assert (window, sliding, full) == (128, 12, 12)
    dense = 4096 * per_layer * len(kinds)
    assert decode_kv_bytes(1, 4096, cfg.kv_bytes_per_token()) == dense  # what it holds
    read = span.decode_kv_read_bytes(cfg, 1, 4096)
    assert read == per_layer * (full * 4096 + sliding * 128)
    assert read / dense == pytest.approx(0.5, abs=0.02)  # (4096 + 128) / 8192
    assert span.decode_kv_read_bytes(cfg, 1, 100) == decode_kv_bytes(1, 100, per_layer * 24)
    assert [span.attended_tokens(cfg, i, 4096) for i in range(4)] == [128, 4096, 128, 4096]
    # a fast engine of the first 2 layers: one sliding, one full
    assert decode_step_bytes_for(cfg, 0, 4, 4096, layers=2).kv == 4 * per_layer * (128 + 4096)


@needs_models
def test_sliding_prefill_grows_linearly_past_the_window() -> None:
    cfg = load_config(MODELS / "gpt-oss-20b.json")
    slide, full = range(0, 1), range(1, 2)  # layer 0 slides, layer 1 attends all

    def flops(isl: int, layers: range) -> float:
        return span.prefill_attention_flops(cfg, isl, layers=layers)

    per_pair = 2 * 64 * (64 + 64)  # 2 FLOPs x 64 heads x (dqk + dv)
    assert flops(128, slide) == flops(128, full) == 128 * 128 / 2 * per_pair
    assert flops(4096, slide) == (128 * 4096 - 128 * 128 / 2) * per_pair
    # past the window: equal steps add equal FLOPs, doubling ISL about doubles them
    step_a = flops(8192, slide) - flops(4096, slide)
    step_b = flops(12288, slide) - flops(8192, slide)
    assert step_a == step_b == 4096 * 128 * per_pair
    assert flops(8192, slide) / flops(4096, slide) == pytest.approx(2.0, rel=0.02)
    assert flops(8192, full) / flops(4096, full) == 4.0  # quadratic
    est = estimate(cfg, H200, OperatingPoint(batch_size=1, isl=32768, context_len=32768),
                   Parallelism())  # fmt: skip
    assert "12 sliding layers (window 128)" in est.term("prefill.flops").source
    assert "linear in ISL past the span" in est.term("prefill.flops").source


# ------------------------------------------------------------------------- GLM-5: DSA
@needs_models
def test_glm5_decode_reads_topk_latents_and_every_indexer_key() -> None:
    cfg, r = load_config(MODELS / "glm-5.json"), raw("glm-5")
    layers, topk = r["num_hidden_layers"], r["index_topk"]
    latent = r["kv_lora_rank"] + r["qk_rope_head_dim"]  # 512 + 64
    index = r["index_head_dim"]  # 128
    ctx = 32768
    expected = layers * (topk * latent + ctx * index) * 2  # bf16
    assert expected == 838_336_512
    assert span.decode_kv_read_bytes(cfg, 1, ctx) == expected
    dense = decode_kv_bytes(1, ctx, cfg.kv_bytes_per_token())
    assert dense == layers * ctx * (latent + index) * 2  # 3.6 GB: what the cache holds
    assert span.decode_kv_read_bytes(cfg, 8, ctx, "float8_e4m3fn") == 8 * expected / 2
    # below top-k every token is attended: the dense read
    for short in (1, 1000, topk):
        assert span.decode_kv_read_bytes(cfg, 2, short) == decode_kv_bytes(
            2, short, cfg.kv_bytes_per_token()
        )
    # FLOPs: 64 heads x 2 x absorbed (576 + 512) over top-k, plus the indexer over all ctx
    heads = r["num_attention_heads"]
    attn = layers * heads * 2 * (latent + r["kv_lora_rank"]) * topk
    indexer = layers * 2 * r["index_n_heads"] * index * ctx
    assert span.decode_attention_flops(cfg, 1, ctx) == pytest.approx(attn + indexer, rel=1e-12)
    # tp splits the attention heads, not the (replicated) indexer
    assert span.decode_attention_flops(cfg, 1, ctx, tp=8) == pytest.approx(
        attn / 8 + indexer, rel=1e-12
    )
    # prefill past top-k: attention linear in ISL, the indexer's scoring still quadratic
    isl = 8192
    qk, v = r["qk_nope_head_dim"] + r["qk_rope_head_dim"], r["v_head_dim"]
    pairs = topk * isl - topk * topk / 2
    expected_prefill = layers * (2 * pairs * heads * (qk + v) + isl * isl / 2 * 2 * 32 * index)
    assert span.prefill_attention_flops(cfg, isl) == pytest.approx(expected_prefill, rel=1e-12)


@needs_models
def test_glm5_roofline_explains_the_sparse_read_and_is_faster_than_dense() -> None:
    cfg, r = load_config(MODELS / "glm-5.json"), raw("glm-5")
    ctx = 32768
    point = OperatingPoint(batch_size=1, isl=1024, context_len=ctx)
    est = estimate(cfg, H200, point, Parallelism())
    kv = est.term("decode.kv_bytes")
    latent = r["kv_lora_rank"] + r["qk_rope_head_dim"]
    expected = 78 * (2048 * latent + ctx * r["index_head_dim"]) * 2
    assert kv.value == expected
    assert "78 sparse layers (DSA top-2,048) × 2,048 tokens" in kv.source
    assert "indexer keys of all 32,768" in kv.source
    assert "indexer key 128 elements" in kv.source
    flops = est.term("decode.flops").source
    assert "indexer 2 × 32 heads × 128 over all context tokens, not split by tp" in flops
    # the memory term reads the sparse KV, not the whole cache
    weights = est.term("decode.weight_bytes_read").value
    memory_ms = (weights + expected) / H200.achievable_bandwidth_bytes_per_s * 1e3
    assert est.term("decode.memory_time_ms").value == pytest.approx(memory_ms, rel=1e-12)
    dense_kv = ctx * cfg.kv_bytes_per_token()
    dense_ms = (weights + dense_kv) / H200.achievable_bandwidth_bytes_per_s * 1e3
    assert est.term("decode.memory_time_ms").value < dense_ms - 0.6  # 2.76 GB less: ~0.65 ms
    # the memory held is still the whole context in every layer
    assert est.kv_bytes_per_device == dense_kv
    # the baselines table's limit gets the same KV number
    assert decode_step_bytes_for(cfg, 1, 1, ctx).kv == kv.value


@needs_models
def test_the_table_limit_reads_the_sliding_span_and_says_so() -> None:
    cfg = load_config(MODELS / "gpt-oss-20b.json")
    c = Comparison(REFERENCE_CANDIDATE.id)
    c.update(
        "ExperimentCompleted",
        {"candidate_id": REFERENCE_CANDIDATE.id, "tier": "full", "status": "ok", "correct": True,
         "tokens_per_s": 100.0, "median_ms": 10.0, "weights_bytes": 13_000_000_000,
         "batch_size": 1, "context_len": 4096, "environment": {"dtype": "bfloat16"}},
    )  # fmt: skip
    limit = c.limit("h200", cfg)
    assert limit is not None and limit.counts_kv
    assert limit.step.kv == 2048 * (12 * 4096 + 12 * 128)
    est = estimate(cfg, H200, OperatingPoint(batch_size=1, isl=64, context_len=4096), Parallelism())
    assert limit.step.kv == est.term("decode.kv_bytes").value
    assert "attention read: 12 sliding layers (window 128) + 12 full layers" in limit.describe()
