"""The real MoE configs (``../shared/data/models``): they parse as transformers would, kiln can
build them, their weights' layout adds up to the published sizes, and one layer binds with the
real shapes. Too big to draw weights for here (Qwen3-30B-A3B at one layer: 1.2B parameters), so
the layer is bound over meta tensors and the MoE ops run on meta inputs (shapes only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.ops.registry import get, implementations
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.workloads.config import load_config
from kiln.workloads.models import DecoderModel, StaticKVCache
from kiln.workloads.models.build import check_buildable
from kiln.workloads.weights import WeightStore, expected_shapes

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")

# (file, experts, top-k, expert width, total params, active params incl. the embedding row read)
# Published: Qwen3-30B-A3B 30.5B total / 3.3B activated (model card); Mixtral-8x7B 46.7B total /
# 12.9B active (Mistral's announcement: "46.7B total parameters but only uses 12.9B per token");
# Qwen3-235B-A22B 235B / 22B (model card).
REAL = [
    ("qwen3-30b-a3b.json", 128, 8, 768, 30.5e9, 3.3e9),
    ("mixtral-8x7b-v0.1.json", 8, 2, 14336, 46.7e9, 12.9e9),
    ("qwen3-235b-a22b.json", 128, 8, 1536, 235e9, 22e9),
]


@pytest.mark.parametrize(("file", "experts", "top_k", "inter", "total", "active"), REAL)
def test_real_moe_configs_parse_build_and_add_up(
    file: str, experts: int, top_k: int, inter: int, total: float, active: float
) -> None:
    cfg = load_config(MODELS / file)
    check_buildable(cfg)
    assert cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (
        experts,
        top_k,
        inter,
    )
    assert cfg.moe.norm_topk_prob and cfg.moe.dense_layers == ()
    assert cfg.moe.round_router_weights == (cfg.model_type == "qwen3_moe")
    shapes = expected_shapes(cfg)
    held = sum(torch.Size(s).numel() for s in shapes.values())
    assert held == cfg.param_count()
    assert held == pytest.approx(total, rel=0.005)
    embed_row = cfg.hidden_size
    assert cfg.active_param_count() + cfg.vocab_size * embed_row == pytest.approx(active, rel=0.02)
    layer0 = "model.layers.0.mlp."
    assert shapes[layer0 + "experts.gate_up_proj"] == (experts, 2 * inter, cfg.hidden_size)
    assert shapes[layer0 + "experts.down_proj"] == (experts, cfg.hidden_size, inter)
    assert shapes[layer0 + "gate.weight"] == (experts, cfg.hidden_size)


@pytest.mark.parametrize("file", [r[0] for r in REAL])
def test_one_real_layer_binds_and_its_moe_ops_run_on_meta(file: str) -> None:
    cfg = load_config(MODELS / file).with_layers(1)
    store = WeightStore(
        {
            n: torch.empty(s, dtype=torch.bfloat16, device="meta")
            for n, s in expected_shapes(cfg).items()
        }
    )
    cache = StaticKVCache(
        layers=1,
        max_batch=2,
        kv_heads=cfg.num_key_value_heads,
        max_len=8,
        head_dim=cfg.head_dim,
        dtype=torch.bfloat16,
        device="meta",
    )
    model = DecoderModel(cfg, store, cache)
    ffn = model.slots.layers[0].ffn
    assert ffn.op == "moe" and ffn.name == "model.layers.0.mlp"
    x = torch.empty(2, 3, cfg.hidden_size, dtype=torch.bfloat16, device="meta")
    for impl in implementations("moe"):  # static shapes: every implementation runs on meta
        assert get("moe", impl)(x, **ffn.params).shape == x.shape
    assert set(implementations("moe")) >= {"reference", "gathered", "dense"}


def test_full_tier_of_qwen3_30b_a3b_on_a_small_host_holds_fewer_layers() -> None:
    workload = {
        "model": {
            "name": "qwen3-30b-a3b",
            "config_json": (MODELS / "qwen3-30b-a3b.json").read_text(),
        },
        "traffic": {"batch_size": 8, "context_len": 256, "expert_zipf_exponent": 0.4},
        "hardware": {"name": "cpu"},
    }
    spec = EngineSpec.from_workload(workload, "full", EngineLimits(max_layers=2))
    assert (spec.layers, spec.total_layers, spec.tier) == (2, 48, "full")
    assert any("scaled to fit by layer count: 2 of 48 layers" in n for n in spec.notes)
    assert spec.expert_zipf_exponent == 0.4
    assert any("hottest expert" in n for n in spec.notes)
