"""Expert-load skew: the traffic statistic (Zipf exponent of block popularity), the Zipf target
over experts, and the router bias that makes a random-weight MoE model's load follow it."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model, measure_expert_load
from kiln.workloads.models.routing import fit_router_bias, load_fractions, target_load
from kiln.workloads.traffic import Request, TrafficShape, read_trace
from kiln.workloads.traffic.experts import (
    block_popularity_exponent,
    exponent_for_hot_ratio,
    hot_ratio,
    zipf_exponent,
    zipf_shares,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"

TINY_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}


# --------------------------------------------------------------------------- the traffic statistic
def test_split_half_mle_recovers_the_exponent_of_a_zipf_sample() -> None:
    rng = random.Random(0)
    n = 2000
    for s in (0.0, 0.5, 1.1):
        weights = [r**-s for r in range(1, n + 1)]
        draws = rng.choices(range(n), weights=weights, k=100_000)
        assert zipf_exponent([[d] for d in draws]) == pytest.approx(s, abs=0.03)
    assert zipf_exponent([[1], [2], [3], [1], [2], [3]]) == 0.0
    assert zipf_exponent([[5], [5]]) == 0.0
    assert zipf_exponent([]) == 0.0


def test_block_popularity_of_requests() -> None:
    every_block_new = [Request(i, 1024, 1, (2 * i, 2 * i + 1)) for i in range(50)]
    assert block_popularity_exponent(every_block_new) == 0.0
    assert block_popularity_exponent([Request(0, 10, 1)]) == 0.0  # no hash ids (Azure)
    shared = [Request(i, 1024, 1, (0, 1 + i % 3, 100 + i)) for i in range(60)]
    assert block_popularity_exponent(shared) > 0.5


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/traces is not here")
@pytest.mark.parametrize(
    ("name", "exponent"),
    [
        ("mooncake_fast25_conversation.jsonl", 0.400),
        ("mooncake_fast25_synthetic.jsonl", 0.400),
        ("azure_llm_2023_conv.csv", 0.0),
    ],
)
def test_real_traces_set_the_exponent(name: str, exponent: float) -> None:
    shape = TrafficShape.from_trace(read_trace(TRACES / name))
    assert shape.expert_zipf_exponent == pytest.approx(exponent, abs=0.001)
    word = "Zipf MLE" if exponent else "no block hash ids"
    assert any("expert_zipf_exponent" in n and word in n for n in shape.notes)
    assert TrafficShape.from_proto(shape.to_proto()) == shape


def test_zipf_shares_are_feasible_and_follow_the_exponent() -> None:
    assert zipf_shares(8, 2, 0.0) == pytest.approx([1 / 8] * 8)
    shares = zipf_shares(8, 2, 0.57)
    assert math.fsum(shares) == pytest.approx(1.0)
    assert shares[0] / shares[1] == pytest.approx(2**0.57)
    capped = zipf_shares(8, 2, 3.0)  # Zipf would give rank 1 ~83 %; an expert takes <= 1/top_k
    assert capped[0] == pytest.approx(0.5) and math.fsum(capped) == pytest.approx(1.0)
    assert capped == sorted(capped, reverse=True)
    assert zipf_shares(4, 4, 2.0) == pytest.approx([0.25] * 4)  # top_k = E: no skew possible
    with pytest.raises(ValueError):
        zipf_shares(4, 5, 1.0)
    with pytest.raises(ValueError):
        zipf_shares(4, 1, -1.0)


def test_hot_ratio_round_trips() -> None:
    assert hot_ratio(128, 8, 0.0) == pytest.approx(1.0)
    for s in (0.3, 0.57, 0.7):  # below the cap (rank 1 at most 1/top_k of the assignments)
        assert exponent_for_hot_ratio(hot_ratio(128, 8, s), 128, 8) == pytest.approx(s, abs=1e-6)
    assert exponent_for_hot_ratio(1.0, 8, 2) == 0.0
    capped = exponent_for_hot_ratio(100.0, 8, 2)  # more than E/k = 4 is impossible
    assert hot_ratio(8, 2, capped) == pytest.approx(4.0)
    assert hot_ratio(8, 2, capped - 0.01) < 4.0


# --------------------------------------------------------------------------- the router bias
def test_fit_router_bias_meets_a_target_on_gaussian_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 16, generator=gen) * 0.3
    target = torch.tensor(zipf_shares(16, 4, 0.8), dtype=torch.float64)
    bias = fit_router_bias(logits, target, 4)
    assert bias.dtype == torch.float32 and bias.shape == (16,)
    held_out = torch.randn(4000, 16, generator=gen) * 0.3
    _, chosen = torch.topk(held_out + bias, 4, dim=-1)
    assert float((load_fractions(chosen, 16) - target).abs().sum()) / 2 < 0.03
    assert torch.equal(bias, fit_router_bias(logits, target, 4))  # deterministic


def test_target_load_is_a_seeded_permutation_per_layer() -> None:
    cfg = parse_config(TINY_MOE, "tiny").with_expert_skew(1.0)
    a, b = target_load(cfg, 0, seed=1), target_load(cfg, 2, seed=1)
    assert sorted(a.tolist(), reverse=True) == pytest.approx(zipf_shares(16, 4, 1.0))
    assert not torch.equal(a, b) and torch.equal(a, target_load(cfg, 0, seed=1))
    assert not torch.equal(a, target_load(cfg, 0, seed=2))


def _held_out(model_vocab: int) -> torch.Tensor:
    return torch.randint(model_vocab, (256, 8), generator=torch.Generator().manual_seed(123))


@pytest.mark.parametrize("s", [0.57, 1.2])
def test_expert_load_follows_the_traffic_skew(s: float) -> None:
    cfg = parse_config(TINY_MOE, "tiny").with_expert_skew(s)
    model = build_model(cfg, dtype=torch.float32, seed=5, max_seq_len=8)
    report = model.expert_load
    assert report is not None and set(report.measured) == {0, 2}  # layer 1 is dense
    assert report.zipf_exponent == s and report.tokens == 256 * 8
    assert report.distance() < 0.06  # held-out prompts, per layer, total variation
    want = zipf_shares(16, 4, s)
    assert report.rank_profile() == pytest.approx(want, abs=0.03)
    assert report.hot_ratio() == pytest.approx(16 * want[0], rel=0.1)
    # fresh prompts again, measured by the public function
    again = measure_expert_load(model, _held_out(cfg.vocab_size), target=report.target)
    assert again.distance() < 0.06
    assert model.weights["model.layers.0.mlp.gate.kiln_skew_bias"].dtype == torch.float32
    assert "model.layers.1.mlp.gate.kiln_skew_bias" not in model.weights


def test_no_skew_no_bias_and_near_uniform_load() -> None:
    cfg = parse_config(TINY_MOE, "tiny")
    model = build_model(cfg, dtype=torch.float32, seed=5, max_seq_len=8)
    assert model.expert_load is None
    assert not any(name.endswith("kiln_skew_bias") for name in model.weights)
    plain = measure_expert_load(model, _held_out(cfg.vocab_size))
    skewed = build_model(cfg.with_expert_skew(1.2), dtype=torch.float32, seed=5, max_seq_len=8)
    assert skewed.expert_load is not None
    assert plain.hot_ratio() < 1.6 < skewed.expert_load.hot_ratio()


def test_biases_are_deterministic_and_the_fast_tier_shares_them() -> None:
    cfg = parse_config(TINY_MOE, "tiny").with_expert_skew(0.8)
    full = build_model(cfg, dtype=torch.float32, seed=5, max_seq_len=8)
    fast = build_model(cfg, layers=1, dtype=torch.float32, seed=5, max_seq_len=8)
    name = "model.layers.0.mlp.gate.kiln_skew_bias"
    # layer 0 is fitted on the same inputs whatever follows it: same bias, bit for bit
    assert torch.equal(full.weights[name], fast.weights[name])
    other = build_model(cfg, dtype=torch.float32, seed=6, max_seq_len=8)
    assert not torch.equal(full.weights[name], other.weights[name])


def test_shared_store_keeps_its_biases_and_checkpoints_get_none(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = parse_config(TINY_MOE, "tiny")
    skewed = build_model(cfg.with_expert_skew(1.0), dtype=torch.float32, seed=5, max_seq_len=8)
    second = build_model(cfg.with_expert_skew(1.0), weights=skewed.weights, max_seq_len=4)
    assert second.expert_load is None  # no second calibration
    bias = second.slots.layers[0].ffn.params["router_bias"]
    assert bias is skewed.weights["model.layers.0.mlp.gate.kiln_skew_bias"]
    plain = {n: t for n, t in skewed.weights.items() if not n.endswith("kiln_skew_bias")}
    save_file({n: t.contiguous() for n, t in plain.items()}, str(tmp_path / "m.safetensors"))
    loaded = build_model(
        cfg.with_expert_skew(1.0), dtype=torch.float32, weights_dir=tmp_path, max_seq_len=8
    )
    assert loaded.expert_load is None
    assert loaded.slots.layers[0].ffn.params["router_bias"] is None
