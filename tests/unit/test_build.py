"""build_model: architectures it refuses, the fast tier, greedy generation."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln.ops.registry import ops
from kiln.runtime.support import MLA_OPS
from kiln.workloads.config import load_config, parse_config
from kiln.workloads.models import UnbuildableModelError, build_model
from kiln.workloads.models.build import check_buildable
from kiln.workloads.models.kv_cache import CacheCapacityError

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"

TINY = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 16,
        "rope_type": "llama3",
    },
}


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_mla_features_not_built_are_refused_by_name() -> None:
    """DeepSeek-V3 builds (tests/unit/test_mla_model.py); a router it does not implement is
    refused by name."""
    raw = json.loads((MODELS / "deepseek-v3.json").read_text())
    check_buildable(load_config(MODELS / "deepseek-v3.json"))
    config = parse_config({**raw, "topk_method": "group_limited_greedy"}, "deepseek-v3")
    with pytest.raises(UnbuildableModelError, match="top-k method 'group_limited_greedy'") as err:
        build_model(config, layers=1)
    assert isinstance(err.value, NotImplementedError)
    assert config.name in str(err.value)


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
@pytest.mark.parametrize("file", ["mixtral-8x7b-v0.1.json", "qwen3-30b-a3b.json"])
def test_moe_models_are_buildable(file: str) -> None:
    check_buildable(load_config(MODELS / file))  # building them: tests/unit/test_moe_models.py


def test_moe_sliding_window_and_shared_experts_are_refused() -> None:
    raw = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    config = parse_config({**raw, "rope_scaling": None}, "tiny-mixtral")
    check_buildable(config)
    with pytest.raises(UnbuildableModelError, match="sliding-window"):
        check_buildable(parse_config({**raw, "rope_scaling": None, "sliding_window": 4096}))
    assert config.moe is not None
    shared = replace(config, moe=replace(config.moe, num_shared_experts=1))
    with pytest.raises(UnbuildableModelError, match="shared experts"):
        check_buildable(shared)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE type 'yarn'"),
        ({"mlp_bias": True}, "MLP biases"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ],
)
def test_unsupported_features_are_named(change: dict[str, object], why: str) -> None:
    with pytest.raises(UnbuildableModelError, match=why):
        build_model(parse_config({**TINY, **change}, "tiny"))


def test_fast_tier_is_the_full_models_first_layers() -> None:
    config = parse_config(TINY, "tiny")
    fast = build_model(config, layers=1, dtype=torch.float32, seed=5, max_seq_len=8)
    one = build_model(config.with_layers(1), dtype=torch.float32, seed=5, max_seq_len=8)
    full = build_model(config, dtype=torch.float32, seed=5, max_seq_len=8)
    assert len(fast.ops.layers) == 1 and len(full.ops.layers) == 3
    assert {site.op for site in full.slots.sites()} == set(ops()) - {
        "moe",
        *MLA_OPS,
        "dsa_index_proj",
        "dsa_indexer",
    }
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(fast.prefill(tokens), one.prefill(tokens), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"1\.\.3"):
        build_model(config, layers=4)


def test_generate_greedy_and_capacity() -> None:
    model = build_model(parse_config(TINY, "tiny"), max_batch=2, max_seq_len=6)
    tokens = torch.tensor([[5, 6, 7], [8, 9, 0]])
    out = model.generate(tokens, torch.tensor([3, 2]), steps=4)
    assert out.shape == (2, 4) and out.dtype == torch.int64
    assert model.cache.lengths.tolist() == [6, 5]
    with pytest.raises(CacheCapacityError):
        model.decode_step(out[:, -1:])
    model.prefill(tokens)
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        model.decode_step(tokens[:1, :1])


def test_engine_imports_without_service_dependencies() -> None:
    code = (
        "import sys, kiln.ops, kiln.workloads.models, kiln.workloads.weights\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'grpc', 'nats', 'sqlalchemy', 'google', 'psycopg', 'alembic', 'transformers'})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
