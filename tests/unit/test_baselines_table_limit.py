"""The honest bandwidth limit (issue 10, item 6): a decode step's bytes are the weights once
plus the KV cache of every sequence at the measured context (one definition,
kiln.cost_model.step_bytes.decode_step_bytes, shared with the roofline estimate); the table's
limit, its description and every "% of limit" use it, and old events without a context fall
back to the weights alone and say so."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rich.console import Console

from kiln.baselines.table import Comparison, bandwidth_limit
from kiln.cli.compile_view import comparison_limit, comparison_table
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism
from kiln.cost_model.step_bytes import (
    decode_kv_bytes,
    decode_step_bytes,
    held_kv_bytes_per_token,
)
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.domain.operating_point import OperatingPoint
from kiln.events.registry import validate_event
from kiln.v1 import common_pb2, compiler_pb2
from kiln.workloads.config import parse_config

LLAMA_1B: dict[str, Any] = {  # Llama-3.2-1B's shape: 16 layers, 8 KV heads of 64
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
CONFIG = parse_config(LLAMA_1B, "llama-3.2-1b")
KV_PER_TOKEN = 2 * 8 * 64 * 16 * 2  # K and V, 8 heads of 64, 16 layers, bf16: 32 KiB
WEIGHTS = 2_470_000_000
H200_BW = get_hardware("h200").achievable_bandwidth_bytes_per_s  # 4.26 TB/s


# ---------------------------------------------------------------------- the one function
def test_kv_bytes_per_token_of_the_layers_held() -> None:
    assert held_kv_bytes_per_token(CONFIG, "bfloat16") == KV_PER_TOKEN
    assert held_kv_bytes_per_token(CONFIG, "float32") == 2 * KV_PER_TOKEN
    assert held_kv_bytes_per_token(CONFIG, "bfloat16", layers=2) == KV_PER_TOKEN // 8  # fast
    assert held_kv_bytes_per_token(CONFIG, "bfloat16", layers=0) == KV_PER_TOKEN
    assert held_kv_bytes_per_token(CONFIG, "bfloat16", layers=99) == KV_PER_TOKEN


def test_decode_step_bytes_weights_only_and_with_kv() -> None:
    alone = decode_step_bytes(WEIGHTS, 1, 0, KV_PER_TOKEN)
    assert alone.kv == 0 and alone.total == WEIGHTS
    assert alone.limit_tokens_per_s(H200_BW) == pytest.approx(H200_BW / WEIGHTS)
    step = decode_step_bytes(WEIGHTS, 1, 7084, KV_PER_TOKEN)
    assert step.kv == 7084 * KV_PER_TOKEN  # 0.23 GB
    assert step.total == WEIGHTS + 7084 * KV_PER_TOKEN
    assert step.limit_tokens_per_s(H200_BW) == pytest.approx(1577, abs=2)
    assert step.limit_tokens_per_s(H200_BW) < alone.limit_tokens_per_s(H200_BW)


def test_batch_reads_the_weights_once_and_every_sequences_kv() -> None:
    one = decode_step_bytes(WEIGHTS, 1, 4096, KV_PER_TOKEN)
    eight = decode_step_bytes(WEIGHTS, 8, 4096, KV_PER_TOKEN)
    assert eight.weights == one.weights
    assert eight.kv == 8 * one.kv
    expected = 8 * H200_BW / (WEIGHTS + 8 * 4096 * KV_PER_TOKEN)
    assert eight.limit_tokens_per_s(H200_BW) == pytest.approx(expected)
    # the KV grows with the batch, so the limit grows less than 8x
    assert eight.limit_tokens_per_s(H200_BW) < 8 * one.limit_tokens_per_s(H200_BW)


def test_the_roofline_estimate_reads_the_same_kv_bytes() -> None:
    point = OperatingPoint(batch_size=4, isl=2048, osl=256, context_len=3000)
    est = estimate(CONFIG, get_hardware("h200"), point, Parallelism())
    assert est.term("decode.kv_bytes").value == decode_kv_bytes(4, 3000, KV_PER_TOKEN)


# ---------------------------------------------------------------------- the table's limit
def test_bandwidth_limit_counts_kv_and_says_so() -> None:
    limit = bandwidth_limit("h200", WEIGHTS, 1, context=7084, kv_bytes_per_token=KV_PER_TOKEN)
    assert limit is not None and limit.counts_kv
    assert limit.tokens_per_s == pytest.approx(H200_BW / (WEIGHTS + 7084 * KV_PER_TOKEN))
    text = limit.describe()
    assert text.startswith("1,577 tok/s = batch x 4.26 TB/s / (weights 2.47 GB + KV 0.23 GB")
    assert "at batch 1, context 7,084)" in text and "weights only" not in text
    assert limit.fraction(limit.tokens_per_s / 2) == pytest.approx(0.5)
    short = bandwidth_limit("h200", WEIGHTS, 1, context=64, kv_bytes_per_token=KV_PER_TOKEN)
    assert short is not None and "+ KV 2.1 MB at batch 1, context 64)" in short.describe()


def test_bandwidth_limit_without_a_context_is_weights_only() -> None:
    limit = bandwidth_limit("h200", WEIGHTS, 1)
    assert limit is not None and not limit.counts_kv
    assert limit.tokens_per_s == pytest.approx(H200_BW / WEIGHTS)  # ~1,725
    assert "weights only (context unknown)" in limit.describe()
    assert "KV" not in limit.describe()
    no_kv = bandwidth_limit("h200", WEIGHTS, 1, context=7084, weights_only_reason="no config")
    assert (
        no_kv is not None
        and no_kv.step.kv == 0
        and "weights only (no config)" in (no_kv.describe())
    )


def _events(*, context: bool = True, floats: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """A compilation's table events; ``context``: the engine recorded where it measured;
    ``floats``: numbers as a Watch Struct delivers them."""
    num = float if floats else int
    point = {"batch_size": num(1), "context_len": num(7084)} if context else {}
    env = {"environment": {"dtype": "bfloat16", "device": "cuda"}} if context else {}
    ok = {"status": "ok", "correct": True, "tier": "full", "batch": num(1)}
    return [
        ("BaselineMeasured", {"tokens_per_s": 300.0, "median_ms": 3.33}),
        (
            "ExperimentCompleted",
            {"candidate_id": "baseline:gpt_fast", "tier": "full", "status": "ok",
             "correct": True, "tokens_per_s": 742.0, "median_ms": 1.348, **point, **env},
        ),
        (
            "ExperimentCompleted",
            {"candidate_id": REFERENCE_CANDIDATE.id, "tier": "full", "status": "ok",
             "correct": True, "tokens_per_s": 400.0, "median_ms": 2.5,
             "weights_bytes": num(WEIGHTS), **point, **env},
        ),
        ("BaselineCompared", {**ok, "name": "gpt_fast", "tokens_per_s": 742.0,
                              "median_ms": 1.348, "weights_bytes": num(WEIGHTS)}),
        ("BaselineCompared", {**ok, "name": "hf_compile", "tokens_per_s": 470.0,
                              "median_ms": 2.13}),
    ]  # fmt: skip


def _comparison(**kw: Any) -> Comparison:
    c = Comparison(REFERENCE_CANDIDATE.id)
    for kind, detail in _events(**kw):
        c.update(kind, detail)
    return c


def _snapshot(config: bool = True, best_tier: int = common_pb2.TIER_FULL) -> Any:
    model = common_pb2.ModelSpec(name="llama-3.2-1b")
    if config:
        model.config_json = json.dumps(LLAMA_1B)
    snap = compiler_pb2.Compilation(
        compilation_id="c1",
        workload=common_pb2.Workload(model=model, hardware=common_pb2.HardwareTarget(name="h200")),
    )
    snap.best.measurement.tokens_per_s = 1000.0
    snap.best.measurement.timing.median_ms = 1.0
    snap.best.measurement.tier = best_tier
    return snap


@pytest.mark.parametrize("floats", [False, True])
def test_comparison_takes_the_operating_point_from_the_full_tier(floats: bool) -> None:
    c = _comparison(floats=floats)
    assert (c.batch(), c.context(), c.dtype(), c.weights_bytes()) == (1, 7084, "bfloat16", WEIGHTS)
    limit = c.limit("h200", CONFIG)
    assert limit is not None and limit.counts_kv
    assert limit.step.kv == 7084 * KV_PER_TOKEN


def test_a_baselines_own_context_wins_and_layers_held_count() -> None:
    c = _comparison()
    c.update("BaselineCompared", {**c.baselines["gpt_fast"], "context": 2000})
    assert c.context() == 2000
    c.full_point = {**(c.full_point or {}), "op_profile_shape": {"layers": 4.0}}
    limit = c.limit("h200", CONFIG)
    assert limit is not None and limit.step.kv == 2000 * KV_PER_TOKEN // 4  # 4 of 16 layers


def test_comparison_of_old_events_is_weights_only() -> None:
    c = _comparison(context=False)
    assert c.context() == 0
    limit = c.limit("h200", CONFIG)
    assert limit is not None and not limit.counts_kv
    assert limit.tokens_per_s == pytest.approx(H200_BW / WEIGHTS)
    assert "weights only (context unknown)" in limit.describe()
    no_config = _comparison().limit("h200", None)
    assert no_config is not None and "weights only (model config unknown)" in (no_config.describe())


def _table_text(c: Comparison, snap: Any) -> tuple[str, dict[str, str]]:
    table = comparison_table(c, snap)
    assert table is not None
    console = Console(width=240, record=True)
    console.print(table)
    text = console.export_text()
    cells = [line.split("│") for line in text.splitlines() if line.count("│") > 2]
    return text, {c[1].strip(): "│".join(c) for c in cells}


def test_compile_view_percent_of_limit_counts_the_kv() -> None:
    c, snap = _comparison(), _snapshot()
    limit = comparison_limit(c, snap)
    assert limit is not None and limit.tokens_per_s == pytest.approx(1577, abs=2)
    text, lines = _table_text(c, snap)
    assert "47%" in lines["gpt_fast"]  # 742 / 1,577 (43% against the weights alone)
    assert "63%" in lines["kiln best"]  # 1000 / 1,577 (58% against the weights alone)
    assert "KV 0.23 GB at batch 1, context 7,084)" in " ".join(text.split())


def test_compile_view_without_the_config_says_weights_only() -> None:
    c, snap = _comparison(), _snapshot(config=False)
    text, lines = _table_text(c, snap)
    assert "43%" in lines["gpt_fast"] and "58%" in lines["kiln best"]
    assert "weights only" in text


def test_a_fast_tier_row_gets_no_fraction_of_the_full_tier_limit() -> None:
    _, lines = _table_text(_comparison(), _snapshot(best_tier=common_pb2.TIER_FAST))
    assert "%" not in lines["kiln best"] and "%" in lines["gpt_fast"]


def test_baseline_compared_takes_a_context_and_reads_old_events() -> None:
    base = {"name": "gpt_fast", "experiment_id": "e1", "status": "ok", "batch": 1}
    _, new = validate_event("compilation-c1", "BaselineCompared", 0, {**base, "context": 7084})
    assert new["context"] == 7084
    _, old = validate_event("compilation-c1", "BaselineCompared", 0, base)
    assert old["context"] == 0


# ------------------------------------------------------------------ MoE: the experts read
def test_expected_experts_read_by_batch_and_skew() -> None:
    from kiln.cost_model.step_bytes import expected_experts_read
    from kiln.workloads.traffic.experts import zipf_shares

    assert expected_experts_read(128, 8, 1) == pytest.approx(8.0)  # one token: its top-8
    thirty = expected_experts_read(128, 8, 30)
    assert thirty == pytest.approx(128 * (1 - (1 - 8 / 128) ** 30))  # ~110 of 128
    assert expected_experts_read(8, 2, 64) == pytest.approx(8.0, rel=1e-6)  # all of them
    skewed = expected_experts_read(128, 8, 30, zipf_shares(128, 8, 1.2))
    assert 8 < skewed < thirty  # hot experts shared between tokens: fewer distinct reads


def test_moe_limit_counts_only_the_experts_the_routing_reads() -> None:
    """Qwen3-30B-A3B holds 48 layers x 128 experts; at batch 1 a step reads 8 of them a layer:
    the limit's weights are the rest of the model plus those 8, not all 61 GB."""
    from kiln.cost_model.step_bytes import moe_unread_expert_bytes

    raw = {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    config = parse_config(raw, "qwen3-30b-a3b")
    held = config.param_count() * 2
    expert = 3 * 2048 * 768 * 2
    unread_b1 = moe_unread_expert_bytes(config, 2, 1)
    assert unread_b1 == pytest.approx(48 * 120 * expert)
    c = _comparison()
    c.update("BaselineCompared", {**c.baselines["gpt_fast"], "weights_bytes": held})
    c.reference_full = {**(c.reference_full or {}), "weights_bytes": held}
    limit = c.limit("h200", config)
    assert limit is not None
    embedding_unread = (151936 - 1) * 2048 * 2  # untied: a step reads one row of the table
    assert limit.step.weights == pytest.approx(held - unread_b1 - embedding_unread, rel=1e-6)
    described = limit.describe()
    assert "MoE: 8.0 of 128 experts a layer read at batch 1 (expected, uniform" in described
    assert "embedding table's unread rows left out" in described
    dense = c.limit("h200", CONFIG)  # the same bytes under a dense, tied config: all read
    assert dense is not None and dense.step.weights == held and "MoE" not in dense.describe()
    untied = c.limit("h200", parse_config({**LLAMA_1B, "tie_word_embeddings": False}, "x"))
    assert untied is not None
    assert untied.step.weights == held - (128256 - 1) * 2048 * 2
    skewed = c.limit("h200", config, expert_zipf_exponent=1.0)
    assert skewed is not None and "Zipf 1" in skewed.describe()
